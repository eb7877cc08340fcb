//! `vps dev`: the server on the embedded database, with tokens printed so a newcomer can try
//! the API at once.

use crate::config::{Config, IdentityConfig};
use crate::database::Database;

/// Runs the dev server until interrupted.
pub async fn run(mut config: Config, _hosts: usize) -> anyhow::Result<i32> {
    if config.identities.is_empty() {
        config.identities = vec![
            IdentityConfig {
                token: format!("op_{}", random_token()),
                identity: "id_operator".into(),
                operator: true,
                tenant: None,
            },
            IdentityConfig {
                token: format!("tk_{}", random_token()),
                identity: "id_alice".into(),
                operator: false,
                tenant: Some("acme".into()),
            },
        ];
    }
    let db = Database::open(&config, 30).await?;
    let server = crate::server::start(config.clone(), db.pool.clone()).await?;
    println!("vps dev is running at {}", server.url());
    println!("database: {}", crate::database::redact(&db.url));
    for id in &config.identities {
        let who = if id.operator {
            "operator".to_string()
        } else {
            format!("tenant {}", id.tenant.as_deref().unwrap_or(""))
        };
        println!("token for {} ({who}): {}", id.identity, id.token);
    }
    println!("press Ctrl-C to stop");
    crate::server::shutdown_signal().await;
    server.shutdown().await;
    db.pool.close().await;
    Ok(0)
}

fn random_token() -> String {
    use rand::Rng;
    let bytes: [u8; 16] = rand::thread_rng().gen();
    hex::encode(bytes)
}
