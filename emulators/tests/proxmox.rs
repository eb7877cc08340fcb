//! What the Proxmox VE client sends and reads beyond the conformance suite.

mod support;

use support::{ProxmoxTarget, Target};
use vps_reactors::providers::{CreateMachine, ProviderErrorCode};

#[tokio::test]
async fn a_vm_is_a_clone_of_the_offer_template_named_after_the_key() {
    let target = ProxmoxTarget::start().await;

    let machine = target
        .provider()
        .create(target.request("inst_vm1"))
        .await
        .unwrap();

    let vms = target.emulator.machines();
    assert_eq!(vms.len(), 1);
    assert_eq!(vms[0].vmid.to_string(), machine.id);
    assert_eq!(vms[0].name, "inst-vm1");
    assert!(vms[0].config["description"].contains("web-1"));
    assert_eq!(vms[0].status, "running");
}

#[tokio::test]
async fn the_user_datas_ssh_keys_reach_cloud_init() {
    let target = ProxmoxTarget::start().await;

    target
        .provider()
        .create(target.request("inst_keys"))
        .await
        .unwrap();

    let vm = &target.emulator.machines()[0];
    // The API keeps the option URI-encoded, as the client sent it.
    assert_eq!(
        vm.config["sshkeys"],
        "ssh-ed25519%20AAAAC3NzaC1lZDI1NTE5%20alice%40example"
    );
}

#[tokio::test]
async fn a_template_that_does_not_exist_is_an_invalid_config() {
    let target = ProxmoxTarget::start().await;
    let request = CreateMachine {
        offer_id: "8999".to_owned(),
        ..target.request("inst_notemplate")
    };

    let error = target.provider().create(request).await.unwrap_err();

    assert_eq!(error.code, ProviderErrorCode::InvalidConfig);
    assert!(error.message.contains("template 8999"), "{}", error.message);
    assert!(target.emulator.machines().is_empty());
}

#[tokio::test]
async fn an_offer_that_is_not_a_vmid_is_an_invalid_config() {
    let target = ProxmoxTarget::start().await;
    let request = CreateMachine {
        offer_id: "cx22".to_owned(),
        ..target.request("inst_badoffer")
    };

    let error = target.provider().create(request).await.unwrap_err();

    assert_eq!(error.code, ProviderErrorCode::InvalidConfig);
}

#[tokio::test]
async fn a_running_vm_can_be_deleted_without_powering_it_off_first() {
    let target = ProxmoxTarget::start().await;
    let provider = target.provider();
    let id = provider
        .create(target.request("inst_hard"))
        .await
        .unwrap()
        .id;

    provider.delete(&id).await.unwrap();

    let error = provider.get(&id).await.unwrap_err();
    assert_eq!(error.code, ProviderErrorCode::NotFound);
}
