//! One conformance suite for every provider implementation: the Hetzner Cloud client against
//! the Hetzner emulator, the Proxmox VE client against the Proxmox emulator, and the
//! in-process emulator. Each case is written once (`mod cases`) and instantiated per target.

mod support;

use support::{EmulatorTarget, HetznerTarget, ProxmoxTarget};

/// Instantiates every case of `mod cases` as a test of one target.
macro_rules! conformance {
    ($target:ident, $start:path) => {
        mod $target {
            conformance!(@cases $start;
                a_created_machine_becomes_running_with_an_address,
                creating_twice_with_the_same_key_yields_one_machine,
                a_create_retried_after_its_answer_was_lost_finds_the_first_machine,
                powering_off_gracefully_stops_the_machine,
                powering_on_a_stopped_machine_runs_it_again,
                a_deleted_machine_is_not_found,
                deleting_an_unknown_machine_is_not_found,
                getting_an_unknown_machine_is_not_found,
                a_machine_removed_behind_the_clients_back_is_not_found,
                a_rate_limited_answer_is_rate_limited_with_a_retry_after,
                a_bad_token_is_an_invalid_config_with_a_clear_message
            );
        }
    };
    (@cases $start:path; $($case:ident),*) => {
        $(
            #[tokio::test]
            async fn $case() {
                let target = $start().await;
                crate::cases::$case(&target).await;
            }
        )*
    };
}

conformance!(hetzner_cloud, crate::HetznerTarget::start);
conformance!(proxmox, crate::ProxmoxTarget::start);
conformance!(in_process_emulator, crate::EmulatorTarget::start);

mod cases {
    use std::time::Duration;

    use vps_reactors::providers::{MachineState, Power, ProviderErrorCode};

    use crate::support::{eventually, eventually_gone, Target};

    /// An id no implementation hands out.
    const UNKNOWN_ID: &str = "424242";

    pub async fn a_created_machine_becomes_running_with_an_address(target: &impl Target) {
        let provider = target.provider();
        let created = provider.create(target.request("inst_first")).await.unwrap();
        assert!(!created.id.is_empty());

        let running = eventually(&*provider, &created.id, |m| {
            m.state == MachineState::Running && !m.addresses.is_empty()
        })
        .await;

        assert_eq!(running.id, created.id);
    }

    pub async fn creating_twice_with_the_same_key_yields_one_machine(target: &impl Target) {
        let provider = target.provider();
        let first = provider.create(target.request("inst_twice")).await.unwrap();
        let second = provider.create(target.request("inst_twice")).await.unwrap();

        assert_eq!(first.id, second.id);
        assert_eq!(target.machine_count(), 1);
    }

    pub async fn a_create_retried_after_its_answer_was_lost_finds_the_first_machine(
        target: &impl Target,
    ) {
        let provider = target.provider();
        target.lose_next_create_answer();

        // Whether the lost answer surfaces as an error depends on the client; either way the
        // machine exists and the retry must find it rather than make another.
        let first = provider.create(target.request("inst_lost")).await;
        let retried = provider.create(target.request("inst_lost")).await.unwrap();

        if let Ok(first) = first {
            assert_eq!(first.id, retried.id);
        }
        assert_eq!(target.machine_count(), 1);
    }

    pub async fn powering_off_gracefully_stops_the_machine(target: &impl Target) {
        let provider = target.provider();
        let id = provider
            .create(target.request("inst_off"))
            .await
            .unwrap()
            .id;
        eventually(&*provider, &id, |m| m.state == MachineState::Running).await;

        provider.power(&id, Power::GracefulOff).await.unwrap();

        eventually(&*provider, &id, |m| m.state == MachineState::Stopped).await;
    }

    pub async fn powering_on_a_stopped_machine_runs_it_again(target: &impl Target) {
        let provider = target.provider();
        let id = provider.create(target.request("inst_on")).await.unwrap().id;
        eventually(&*provider, &id, |m| m.state == MachineState::Running).await;
        provider.power(&id, Power::GracefulOff).await.unwrap();
        eventually(&*provider, &id, |m| m.state == MachineState::Stopped).await;

        provider.power(&id, Power::On).await.unwrap();

        eventually(&*provider, &id, |m| {
            m.state == MachineState::Running && !m.addresses.is_empty()
        })
        .await;
    }

    pub async fn a_deleted_machine_is_not_found(target: &impl Target) {
        let provider = target.provider();
        let id = provider
            .create(target.request("inst_gone"))
            .await
            .unwrap()
            .id;
        eventually(&*provider, &id, |m| m.state == MachineState::Running).await;

        provider.delete(&id).await.unwrap();

        eventually_gone(&*provider, &id).await;
        let again = provider.delete(&id).await.unwrap_err();
        assert_eq!(again.code, ProviderErrorCode::NotFound);
    }

    pub async fn deleting_an_unknown_machine_is_not_found(target: &impl Target) {
        let error = target.provider().delete(UNKNOWN_ID).await.unwrap_err();

        assert_eq!(error.code, ProviderErrorCode::NotFound);
    }

    pub async fn getting_an_unknown_machine_is_not_found(target: &impl Target) {
        let error = target.provider().get(UNKNOWN_ID).await.unwrap_err();

        assert_eq!(error.code, ProviderErrorCode::NotFound);
        assert!(error.message.contains(UNKNOWN_ID), "{}", error.message);
    }

    pub async fn a_machine_removed_behind_the_clients_back_is_not_found(target: &impl Target) {
        let provider = target.provider();
        let id = provider
            .create(target.request("inst_vanish"))
            .await
            .unwrap()
            .id;

        target.remove_behind_the_clients_back(&id);

        let error = provider.get(&id).await.unwrap_err();
        assert_eq!(error.code, ProviderErrorCode::NotFound);
    }

    pub async fn a_rate_limited_answer_is_rate_limited_with_a_retry_after(target: &impl Target) {
        let provider = target.provider();
        target.rate_limit_next();

        let error = provider.get(UNKNOWN_ID).await.unwrap_err();

        assert_eq!(error.code, ProviderErrorCode::RateLimited);
        assert_eq!(error.retry_after, Some(Duration::from_secs(1)));
        assert!(!error.is_terminal());
        // Throttling passes: the next call is served.
        let next = provider.get(UNKNOWN_ID).await.unwrap_err();
        assert_eq!(next.code, ProviderErrorCode::NotFound);
    }

    pub async fn a_bad_token_is_an_invalid_config_with_a_clear_message(target: &impl Target) {
        // The in-process emulator has no credentials to get wrong.
        let Some(provider) = target.provider_with_bad_credentials() else {
            return;
        };

        let error = provider
            .create(target.request("inst_denied"))
            .await
            .unwrap_err();

        assert_eq!(error.code, ProviderErrorCode::InvalidConfig);
        assert!(error.is_terminal());
        assert!(
            error.message.contains("rejected the API token"),
            "{}",
            error.message
        );
        assert_eq!(target.machine_count(), 0);
    }
}
