//! `vps images build minimal --out FILE`: a small guest bundle made from Debian's packages
//! (cloud kernel, busybox, OpenSSH's sshd; see docs/guest-contract.md).
//!
//! `vps images import FILE --image-id ID`: keeps an image (such a bundle, or a qcow2 disk) in
//! the deployment's object store and registers it, so hosts fetch it through a URL signed when
//! their spec is served.

use std::path::{Path, PathBuf};

use clap::{Arg, ArgMatches, Command};
use serde_json::json;
use sha2::{Digest, Sha256};

use super::Client;

/// `images build`: local, no server.
pub fn build_command() -> Command {
    Command::new("build")
        .about("Builds a guest image from Debian's packages (needs apt-get and dpkg-deb).")
        .arg(
            Arg::new("kind")
                .required(true)
                .value_parser(["minimal"])
                .help("minimal: cloud kernel, busybox and sshd in an initramfs"),
        )
        .arg(
            Arg::new("out")
                .long("out")
                .required(true)
                .value_parser(clap::value_parser!(PathBuf))
                .help("The bundle to write (a tar)"),
        )
        .arg(
            Arg::new("workDir")
                .long("work-dir")
                .default_value(".vps/guest-build")
                .value_parser(clap::value_parser!(PathBuf))
                .help("Where downloaded packages are kept between builds"),
        )
}

/// Runs `images build`: 0 once the bundle is written, 1 if the build failed.
pub fn run_build(m: &ArgMatches) -> i32 {
    let (Some(out), Some(work)) = (m.get_one::<PathBuf>("out"), m.get_one::<PathBuf>("workDir"))
    else {
        return 2;
    };
    match vps_guest_image::build_minimal(out, work, |step| eprintln!("{step}")) {
        Ok(()) => {
            println!("{}", out.display());
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// The command's arguments (the connection ones are added by the caller).
pub fn import_command() -> Command {
    Command::new("import")
        .about(
            "Uploads an image file to the deployment's object store and registers it (operator).",
        )
        .arg(
            Arg::new("file")
                .required(true)
                .value_parser(clap::value_parser!(PathBuf))
                .help("A bundle (vps images build minimal) or a qcow2 disk"),
        )
        .arg(
            Arg::new("imageId")
                .long("image-id")
                .visible_alias("image")
                .required(true)
                .help("The id to register it as"),
        )
        .arg(
            Arg::new("format")
                .long("format")
                .value_parser(["bundle", "qcow2"])
                .default_value("bundle")
                .help("bundle (kernel, initrd, optional rootfs) or qcow2"),
        )
        .arg(
            Arg::new("tenantId")
                .long("tenant")
                .help("The owning tenant; none: a public image"),
        )
}

/// Runs it: 0 once registered, 1 on an API or transfer failure, 2 on a usage error.
pub async fn run_import(client: &Client, m: &ArgMatches) -> i32 {
    let Some(file) = m.get_one::<PathBuf>("file") else {
        return 2;
    };
    let text = |name: &str| m.get_one::<String>(name).cloned();
    let (sha256, size) = match digest(file).await {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {}: {e}", file.display());
            return 2;
        }
    };
    let Ok(target) = client
        .call("images.upload", &json!({ "sha256": sha256 }))
        .await
    else {
        return 1;
    };
    eprintln!(
        "uploading {} ({size} bytes, sha256 {sha256})",
        file.display()
    );
    if let Err(e) = put(file, &target, &sha256, size).await {
        eprintln!("error: upload failed: {e}");
        return 1;
    }
    let mut register = json!({
        "imageId": text("imageId"),
        "url": target["url"],
        "sha256": sha256,
        "format": text("format"),
        "verified": true,
    });
    if let Some(tenant) = text("tenantId") {
        register["tenantId"] = tenant.into();
    }
    match client.call("images.register", &register).await {
        Ok(image) => {
            super::output::print(&image, false);
            0
        }
        Err(code) => code,
    }
}

/// The file's SHA-256 (hex) and size, read in chunks: an image may be gigabytes.
async fn digest(file: &Path) -> std::io::Result<(String, u64)> {
    use tokio::io::AsyncReadExt;
    let mut f = tokio::fs::File::open(file).await?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((data_encoding::HEXLOWER.encode(&hasher.finalize()), size))
}

/// `PUT`s the file to the presigned URL with exactly the headers given, plus its digest (the
/// built-in store checks it as it writes).
async fn put(
    file: &Path,
    target: &serde_json::Value,
    sha256: &str,
    size: u64,
) -> anyhow::Result<()> {
    let url = target["uploadUrl"].as_str().unwrap_or_default();
    let body = tokio::fs::File::open(file).await?;
    let mut request = reqwest::Client::new()
        .put(url)
        .header(reqwest::header::CONTENT_LENGTH, size)
        .header(vps_store::SHA256_HEADER, sha256)
        .body(reqwest::Body::wrap_stream(
            tokio_util::io::ReaderStream::new(body),
        ));
    if let Some(headers) = target["uploadHeaders"].as_object() {
        for (name, value) in headers {
            request = request.header(name, value.as_str().unwrap_or_default());
        }
    }
    let answer = request.send().await?;
    anyhow::ensure!(
        answer.status().is_success(),
        "the store answered {}",
        answer.status()
    );
    Ok(())
}
