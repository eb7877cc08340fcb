//! What the Hetzner Cloud client sends and reads beyond the conformance suite.

mod support;

use support::{HetznerTarget, Target};
use vps_reactors::providers::{machine_name, ProviderErrorCode};

#[tokio::test]
async fn a_server_is_named_after_the_key_and_created_with_the_offer_image_and_user_data() {
    let target = HetznerTarget::start().await;
    let request = target.request("inst_abc234");

    target.provider().create(request.clone()).await.unwrap();

    let servers = target.emulator.machines();
    assert_eq!(servers.len(), 1);
    let server = &servers[0];
    assert_eq!(server.name, machine_name("inst_abc234"));
    assert_eq!(server.name, "inst-abc234");
    assert_eq!(server.server_type, "cx22");
    assert_eq!(server.image, "ubuntu-24.04");
    assert_eq!(server.user_data, request.user_data);
    assert_eq!(server.labels["vps-idempotency-key"], "inst_abc234");
}

#[tokio::test]
async fn a_create_that_loses_the_race_for_its_name_returns_the_winners_server() {
    let target = HetznerTarget::start().await;
    let provider = target.provider();
    let winner = provider.create(target.request("inst_race")).await.unwrap();

    // The lookup misses, so the create reaches POST /servers and meets `uniqueness_error`.
    target.emulator.hide_next_name_lookups(1);
    let loser = provider.create(target.request("inst_race")).await.unwrap();

    assert_eq!(loser.id, winner.id);
    assert_eq!(target.emulator.machines().len(), 1);
}

#[tokio::test]
async fn a_server_reports_its_public_ipv4_and_ipv6_host_address() {
    let target = HetznerTarget::start().await;
    let provider = target.provider();

    let machine = provider.create(target.request("inst_ips")).await.unwrap();

    assert_eq!(machine.addresses.len(), 2);
    assert!(machine.addresses[0].starts_with("203.0.113."));
    assert!(machine.addresses[1].starts_with("2001:db8:") && machine.addresses[1].ends_with("::1"));
}

#[tokio::test]
async fn an_unknown_location_is_an_invalid_config() {
    let target = HetznerTarget::start().await;
    let config = serde_json::json!({
        "baseUrl": target.base_url, "token": target.emulator.token(), "location": "mars1"
    });
    let provider = vps_reactors::providers::build(
        vps_reactors::providers::ProviderConfig::parse("hetzner-cloud", &config).unwrap(),
    );

    let error = provider
        .create(target.request("inst_mars"))
        .await
        .unwrap_err();

    assert_eq!(error.code, ProviderErrorCode::InvalidConfig);
    assert!(error.message.contains("location"), "{}", error.message);
}

#[tokio::test]
async fn a_server_error_is_a_retryable_provider_error() {
    let target = HetznerTarget::start().await;
    target
        .emulator
        .fail_next(1, vps_emulators::Fault::ServerError);

    let error = target.provider().get("1").await.unwrap_err();

    assert_eq!(error.code, ProviderErrorCode::ProviderError);
    assert!(!error.is_terminal());
}
