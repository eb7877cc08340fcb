//! The web console in a real headless Chromium: signing in, creating an instance through the
//! form and watching it run and go without reloading the page, and every other page rendering.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use vps_tests::browser::Browser;
use vps_tests::{acme_instance, acme_sandbox, TestServer, ALICE};

/// Where the screenshot goes: `VPS_CONSOLE_SCREENSHOT`, or the test output directory.
fn screenshot_path() -> PathBuf {
    std::env::var_os("VPS_CONSOLE_SCREENSHOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-screenshot.png")
        })
}

/// The state shown in the instance list's row for `id`.
fn row_state(id: &str) -> String {
    format!(
        "(document.querySelector('#instances tr[data-id=\"{id}\"] td.state') || {{}}).textContent"
    )
}

#[tokio::test]
async fn the_console_creates_an_instance_and_watches_it_run_and_go() {
    let t = TestServer::start_with(|c| {
        c.timings.transitional_look = 0.1;
        // Usage recorded per second, for the usage chart.
        c.timings.usage_window = 1.0;
    })
    .await;
    let (pool, _host) = t
        .pool_with_host("10.0.0.0/24", Duration::from_millis(500))
        .await;
    let mut browser = Browser::launch(1280, 800).await;

    // Signing in with the token and the tenant.
    browser.goto(&format!("{}/console", t.server.url())).await;
    browser.type_into("#signin-token", ALICE).await;
    browser.type_into("#signin-tenant", "acme").await;
    browser.click("#signin-form button[type=submit]").await;
    browser
        .wait_for(
            "the instances page",
            "document.querySelector('#create-instance')",
        )
        .await;
    assert_eq!(browser.text("#tenant-name").await, "acme");
    // Marks this page load: a reload would drop it.
    browser.eval("window.notReloaded = true").await;

    // Creating an instance through the form; the list shows it reach `running` by itself.
    browser
        .type_into("#create-instance [name=poolId]", &pool)
        .await;
    browser
        .type_into("#create-instance [name=flavor]", "small")
        .await;
    browser
        .type_into("#create-instance [name=imageId]", "img_ubuntu")
        .await;
    browser.click("#create-button").await;
    let id = browser
        .wait_for(
            "the created instance's id",
            "(document.querySelector('#create-result a') || {}).textContent",
        )
        .await;
    let id = id.as_str().unwrap().to_string();
    assert!(id.starts_with("inst_"), "{id}");
    browser
        .wait_for(
            &format!("{id} running in the list"),
            &format!("{} === 'running'", row_state(&id)),
        )
        .await;
    assert_eq!(browser.eval("window.notReloaded").await, json!(true));
    let api = t.ok(ALICE, "instances.get", acme_instance(&id)).await;
    assert_eq!(api["state"], "running");
    assert_eq!(
        browser
            .text(&format!("#instances tr[data-id=\"{id}\"] td:nth-child(3)"))
            .await,
        pool
    );
    let shot = screenshot_path();
    browser.screenshot(&shot).await;
    assert!(
        std::fs::metadata(&shot).unwrap().len() > 10_000,
        "{}",
        shot.display()
    );
    eprintln!("console screenshot: {}", shot.display());

    // Its page: the history, then Delete (asked twice), and `deleted` shown live.
    browser
        .click(&format!("#instances a[href=\"#/instances/{id}\"]"))
        .await;
    browser
        .wait_for(
            "the instance's history",
            "[...document.querySelectorAll('#instance-history td')].some(td => td.textContent === 'instance.created')",
        )
        .await;
    assert_eq!(browser.text("#instance-state").await, "running");
    browser.click("#instance-delete").await;
    assert_eq!(browser.text("#instance-delete").await, "Confirm delete");
    browser.click("#instance-delete").await;
    browser
        .wait_for(
            "the instance deleted",
            "(document.querySelector('#instance-state') || {}).textContent === 'deleted'",
        )
        .await;
    browser.click("a[href=\"#/instances\"]").await;
    browser
        .wait_for(
            &format!("{id} deleted in the list"),
            &format!("{} === 'deleted'", row_state(&id)),
        )
        .await;
    assert_eq!(browser.eval("window.notReloaded").await, json!(true));

    // The live events page follows the stream from the start of the tenant's log.
    browser.click("nav a[href=\"#/events\"]").await;
    browser
        .wait_for(
            "the stream's instance.deleted",
            "(document.querySelector('#events-status') || {}).textContent === 'live' && \
             [...document.querySelectorAll('#event-log td')].some(td => td.textContent === 'instance.deleted')",
        )
        .await;

    // The usage chart once the instance's running seconds are recorded; every other page
    // renders without an error.
    let today = vps_clock::Clock::system().now().date_naive();
    let (from, to) = (today.pred_opt().unwrap(), today.succ_opt().unwrap());
    vps_tests::wait_until("usage recorded", vps_tests::PATIENCE, || async {
        let page = t
            .ok(
                ALICE,
                "usage.list",
                json!({ "tenantId": "acme", "from": format!("{from}T00:00:00Z"), "to": format!("{to}T00:00:00Z") }),
            )
            .await;
        !page["items"].as_array().unwrap().is_empty()
    })
    .await;
    for (page, ready) in [
        ("sandboxes", "#sandboxes tbody tr"),
        ("templates", "#templates tbody tr"),
        ("volumes", "#volumes tbody tr"),
        ("usage", "#usage-charts section[data-meter] svg rect"),
    ] {
        browser.click(&format!("nav a[href=\"#/{page}\"]")).await;
        browser
            .wait_for(
                &format!("the {page} page"),
                &format!("document.querySelector({})", json!(ready)),
            )
            .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            browser
                .eval("document.getElementById('error').hidden")
                .await
                == json!(true),
            "{page}: {}",
            browser.text("#error").await
        );
    }

    // A sandbox made elsewhere shows up in the list by itself; its page extends and deletes it.
    let template = t.sandbox_template(&pool, "py", json!({})).await;
    let sandbox = t
        .ok(
            ALICE,
            "sandboxes.create",
            json!({ "tenantId": "acme", "templateId": template["id"], "idempotencyKey": "console-sbx",
                    "ttlSeconds": 600, "wait": { "timeoutMs": 20000 } }),
        )
        .await;
    let sbx = sandbox["id"].as_str().unwrap();
    browser.click("nav a[href=\"#/sandboxes\"]").await;
    browser
        .click(&format!("#sandboxes a[href=\"#/sandboxes/{sbx}\"]"))
        .await;
    browser
        .wait_for(
            "the sandbox ready with its snapshots table",
            "(document.querySelector('#sandbox-state') || {}).textContent === 'ready' && \
             document.querySelector('#sandbox-snapshots')",
        )
        .await;
    browser.click("#sandbox-extend").await;
    let expiry = |s: &serde_json::Value| {
        chrono::DateTime::parse_from_rfc3339(s["expiresAt"].as_str().unwrap()).unwrap()
    };
    let sandbox_ref = acme_sandbox(sbx);
    vps_tests::wait_until(
        "the sandbox extended by 30 minutes",
        vps_tests::PATIENCE,
        || async {
            let now = t.ok(ALICE, "sandboxes.get", sandbox_ref.clone()).await;
            expiry(&now) - expiry(&sandbox) == chrono::Duration::minutes(30)
        },
    )
    .await;
    browser.click("#sandbox-delete").await;
    browser.click("#sandbox-delete").await;
    browser
        .wait_for(
            "the sandbox going",
            "['deleting', 'deleted'].includes((document.querySelector('#sandbox-state') || {}).textContent)",
        )
        .await;
    browser.click("nav a[href=\"#/templates\"]").await;
    browser
        .wait_for(
            "the template listed",
            &format!(
                "document.querySelector('#templates tr[data-id=\"{}\"]')",
                template["id"].as_str().unwrap()
            ),
        )
        .await;
    assert!(browser.page_errors.is_empty(), "{:?}", browser.page_errors);
}
