//! The `s3` backend: an S3 bucket (or any S3-compatible server), with URLs presigned by the
//! `object_store` crate (SigV4 query signing, path-style so a plain endpoint works).

use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::signer::Signer;
use object_store::ObjectStore;

use crate::{Presigned, StoreError};

/// `[snapshots]` with `store = "s3"`.
#[derive(Debug, Clone)]
pub struct S3Config {
    /// The bucket.
    pub bucket: String,
    /// The API endpoint, e.g. `https://s3.eu-central-1.amazonaws.com` or `http://127.0.0.1:9000`.
    pub endpoint: String,
    /// The region the signatures name.
    pub region: String,
    /// The access key id.
    pub access_key_id: String,
    /// The secret access key.
    pub secret_access_key: String,
}

/// An S3 bucket.
#[derive(Debug, Clone)]
pub struct S3Store {
    client: Arc<AmazonS3>,
}

impl S3Store {
    /// A store on `config`'s bucket. Nothing is sent until a delete or an existence check.
    pub fn new(config: &S3Config) -> Result<Self, StoreError> {
        let client = AmazonS3Builder::new()
            .with_bucket_name(&config.bucket)
            .with_endpoint(&config.endpoint)
            .with_region(&config.region)
            .with_access_key_id(&config.access_key_id)
            .with_secret_access_key(&config.secret_access_key)
            .with_allow_http(config.endpoint.starts_with("http://"))
            .with_virtual_hosted_style_request(false)
            .build()?;
        Ok(Self {
            client: Arc::new(client),
        })
    }

    pub(crate) async fn presign(
        &self,
        method: http::Method,
        key: &str,
        ttl: Duration,
    ) -> Result<Presigned, StoreError> {
        let url = self
            .client
            .signed_url(method, &Path::from(key), ttl)
            .await?;
        Ok(Presigned {
            url: url.to_string(),
            headers: Default::default(),
        })
    }

    pub(crate) async fn delete(&self, key: &str) -> Result<(), StoreError> {
        match self.client.delete(&Path::from(key)).await {
            Err(object_store::Error::NotFound { .. }) | Ok(()) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    pub(crate) async fn exists(&self, key: &str) -> Result<bool, StoreError> {
        match self.client.head(&Path::from(key)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}
