//! The exec tunnel endpoint (SPEC §3.7, §3.11): the same first-line ticket protocol as the
//! emulated host, then a plain byte pipe to the guest's own `sshd`.
//!
//! A client connects and sends its ticket and a newline. The host redeems it once
//! (`nodes.redeemTicket`), which names the instance, the principal of the client's certificate
//! and when that certificate ends. The tunnel is refused, and no connection to any guest is
//! opened, when the ticket is unknown or used, the certificate has ended, the instance is not
//! running on this host, or the principal is not the one that instance's `sshd` admits. Else
//! the rest of the stream goes to the guest's `sshd`, which checks the certificate itself
//! (`TrustedUserCAKeys`, `AuthorizedPrincipalsFile`).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument;
use vps_clock::Clock;
use vps_seam::{NodeApi, Redeemed};

use crate::runtime::Runtime;

/// How long the guest's `sshd` may take to accept the connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The guests a tunnel may reach now: each running guest and the principal its `sshd` admits.
/// The agent's loop writes it after every look at the guests.
#[derive(Default)]
pub struct Targets(Mutex<HashMap<String, String>>);

impl Targets {
    /// Replaces the set.
    pub fn set(&self, targets: HashMap<String, String>) {
        *self.lock() = targets;
    }

    /// The principal `id`'s `sshd` admits, when it runs here.
    pub fn principal(&self, id: &str) -> Option<String> {
        self.lock().get(id).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        // A panic elsewhere cannot leave the map half-written: take it as it is.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Accepts tunnels until the task is aborted.
pub async fn serve<R: Runtime>(
    listener: TcpListener,
    runtime: Arc<R>,
    api: NodeApi,
    targets: Arc<Targets>,
) {
    loop {
        let (stream, peer) = vps_seam::tunnel::accept(&listener).await;
        let (runtime, api, targets) = (runtime.clone(), api.clone(), targets.clone());
        let span = tracing::info_span!("tunnel", %peer);
        tokio::spawn(connection(stream, runtime, api, targets).instrument(span));
    }
}

/// One tunnel: the ticket line, its redeem and checks, then the pipe.
async fn connection<R: Runtime>(
    mut stream: TcpStream,
    runtime: Arc<R>,
    api: NodeApi,
    targets: Arc<Targets>,
) {
    let admitted = admit(&mut stream, runtime.as_ref(), &api, &targets).await;
    let (guest, instance) = match admitted {
        Ok(admitted) => admitted,
        Err(refusal) => {
            tracing::info!(%refusal, "tunnel refused");
            crate::metrics::tunnel(false);
            vps_seam::tunnel::refuse(&mut stream, &refusal).await;
            return;
        }
    };
    let connected = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(guest)).await;
    let mut sshd = match connected {
        Ok(Ok(sshd)) => sshd,
        Ok(Err(error)) => {
            let refusal = format!("the sshd of {instance} does not answer: {error}");
            tracing::warn!(%refusal, "tunnel refused");
            crate::metrics::tunnel(false);
            vps_seam::tunnel::refuse(&mut stream, &refusal).await;
            return;
        }
        Err(_) => {
            let refusal = format!("the sshd of {instance} does not answer in time");
            tracing::warn!(%refusal, "tunnel refused");
            crate::metrics::tunnel(false);
            vps_seam::tunnel::refuse(&mut stream, &refusal).await;
            return;
        }
    };
    crate::metrics::tunnel(true);
    tracing::info!(%instance, %guest, "tunnel opened");
    let _ = stream.set_nodelay(true);
    let _ = sshd.set_nodelay(true);
    match tokio::io::copy_bidirectional(&mut stream, &mut sshd).await {
        Ok((up, down)) => tracing::info!(%instance, up, down, "tunnel closed"),
        // A side hanging up mid-stream ends the tunnel: nothing to act on.
        Err(error) => tracing::debug!(%instance, %error, "tunnel ended"),
    }
}

/// Reads and redeems the ticket, and answers where its guest's `sshd` listens.
async fn admit<R: Runtime>(
    stream: &mut TcpStream,
    runtime: &R,
    api: &NodeApi,
    targets: &Targets,
) -> Result<(SocketAddr, String), String> {
    let ticket = vps_seam::tunnel::read_ticket(stream).await?;
    let redeemed = api
        .redeem_ticket(&ticket)
        .await
        .map_err(|e| format!("ticket: {e}"))?;
    let admits = targets.principal(&redeemed.instance_id);
    let address = runtime.ssh_address(&redeemed.instance_id);
    let guest = check(&redeemed, admits.as_deref(), address, Clock::system().now())?;
    Ok((guest, redeemed.instance_id))
}

/// Whether a redeemed ticket opens a tunnel: `admits` is the principal the instance's `sshd`
/// admits when it runs here, `address` where that `sshd` listens.
pub fn check(
    redeemed: &Redeemed,
    admits: Option<&str>,
    address: Option<(IpAddr, u16)>,
    now: DateTime<Utc>,
) -> Result<SocketAddr, String> {
    let instance = &redeemed.instance_id;
    match redeemed.valid_before {
        Some(end) if end > now => {}
        Some(end) => return Err(format!("the certificate ended at {end}")),
        None => return Err("the server named no end for the certificate".into()),
    }
    let Some(admits) = admits else {
        return Err(format!("instance {instance} is not running here"));
    };
    if redeemed.principal != admits {
        return Err(format!(
            "the certificate's principal {:?} is not the one instance {instance} admits",
            redeemed.principal
        ));
    }
    let Some((ip, port)) = address else {
        return Err(format!("instance {instance} has no address to reach"));
    };
    Ok(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use chrono::TimeDelta;

    use super::*;

    fn redeemed(principal: &str, ends_in: i64, now: DateTime<Utc>) -> Redeemed {
        Redeemed {
            instance_id: "inst_a".into(),
            principal: principal.into(),
            valid_before: Some(now + TimeDelta::seconds(ends_in)),
            ca_public_key: None,
        }
    }

    const SSHD: Option<(IpAddr, u16)> =
        Some((IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2)), 22));

    #[test]
    fn a_valid_ticket_for_a_running_guest_reaches_its_sshd() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let at = check(&redeemed("inst_a", 60, now), Some("inst_a"), SSHD, now).unwrap();
        assert_eq!(at.to_string(), "10.0.0.2:22");
    }

    #[test]
    fn an_ended_certificate_is_refused() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let e = check(&redeemed("inst_a", -1, now), Some("inst_a"), SSHD, now).unwrap_err();
        assert!(e.contains("ended"), "{e}");
        let e = check(&redeemed("inst_a", 0, now), Some("inst_a"), SSHD, now).unwrap_err();
        assert!(e.contains("ended"), "{e}");
        let mut no_end = redeemed("inst_a", 60, now);
        no_end.valid_before = None;
        assert!(check(&no_end, Some("inst_a"), SSHD, now).is_err());
    }

    #[test]
    fn a_guest_not_running_here_is_refused() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let e = check(&redeemed("inst_a", 60, now), None, SSHD, now).unwrap_err();
        assert!(e.contains("not running here"), "{e}");
        let e = check(&redeemed("inst_a", 60, now), Some("inst_a"), None, now).unwrap_err();
        assert!(e.contains("no address"), "{e}");
    }

    #[test]
    fn a_principal_the_guest_does_not_admit_is_refused() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let e = check(&redeemed("inst_b", 60, now), Some("inst_a"), SSHD, now).unwrap_err();
        assert!(e.contains("\"inst_b\""), "{e}");
    }
}
