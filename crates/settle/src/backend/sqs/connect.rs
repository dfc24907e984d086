//! Connecting to SQS: where the server is and how to reach it ([`SqsSettings`]: the Backend's
//! `spec.sqs` with its Secret read, or an application's own), the credentials (the pod's
//! identity or an access key), and the client made from them over rustls (ring).
//!
//! It must not read Kubernetes objects (the caller passes the Secret's keys) nor make queues.

use aws_sdk_sqs::Client;

use super::{SqsBroker, SqsError};
use crate::bus::BusError;

/// Credentials for SQS. `Debug` shows the access key id, never the secret key.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub enum SqsCredentials {
    /// The pod's identity: the AWS SDK's default chain (environment, IRSA web identity, EKS Pod
    /// Identity, instance profile).
    #[default]
    DefaultChain,
    /// An access key (from the Backend's Secret: `accessKeyId`, `secretAccessKey`).
    Static {
        access_key_id: String,
        secret_access_key: String,
    },
}

impl std::fmt::Debug for SqsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SqsCredentials::DefaultChain => f.write_str("DefaultChain"),
            SqsCredentials::Static { access_key_id, .. } => f
                .debug_struct("Static")
                .field("access_key_id", access_key_id)
                .field("secret_access_key", &"<redacted>")
                .finish(),
        }
    }
}

/// Where SQS is and how to reach it: the Backend's `spec.sqs`, with its Secret read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct SqsSettings {
    /// The region; `None`: the SDK's (AWS_REGION, the profile, the instance).
    pub region: Option<String>,
    /// An endpoint replacing the region's (ElasticMQ, a VPC endpoint).
    pub endpoint: Option<String>,
    pub credentials: SqsCredentials,
    /// Put before every queue name.
    pub queue_prefix: String,
}

impl SqsSettings {
    /// A fingerprint of the settings (credentials included), to tell a changed Secret apart.
    pub fn fingerprint(&self) -> u64 {
        crate::backend::fingerprint(self)
    }

    /// From a Backend's `spec.sqs` and, when it names a Secret, the Secret's two keys.
    pub fn from_spec(spec: &crate::api::SqsBackendSpec, credentials: SqsCredentials) -> Self {
        SqsSettings {
            region: spec.region.clone(),
            endpoint: spec.endpoint.clone(),
            credentials,
            queue_prefix: spec.queue_prefix.clone().unwrap_or_default(),
        }
    }
}

impl SqsBroker {
    /// A client for these settings, over rustls (ring).
    pub async fn connect(settings: SqsSettings) -> Result<SqsBroker, BusError> {
        use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
            .build_https();
        let mut loader =
            aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http);
        if let Some(region) = settings.region.clone() {
            loader = loader.region(aws_config::Region::new(region));
        }
        if let Some(endpoint) = settings.endpoint.clone() {
            loader = loader.endpoint_url(endpoint);
        }
        if let SqsCredentials::Static {
            access_key_id,
            secret_access_key,
        } = settings.credentials
        {
            loader = loader.credentials_provider(aws_sdk_sqs::config::Credentials::new(
                access_key_id,
                secret_access_key,
                None,
                None,
                "settle-backend-secret",
            ));
        }
        let config = loader.load().await;
        if config.region().is_none() {
            return Err(SqsError::Config(
                "no AWS region: set spec.sqs.region on the Backend (or AWS_REGION in the pod)"
                    .into(),
            )
            .into());
        }
        Ok(SqsBroker::from_client(
            Client::new(&config),
            settings.queue_prefix,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_prints_the_secret_key() {
        let settings = SqsSettings {
            credentials: SqsCredentials::Static {
                access_key_id: "AKIAEXAMPLE".into(),
                secret_access_key: "s3cr3t".into(),
            },
            ..SqsSettings::default()
        };
        let text = format!("{settings:?}");
        assert!(!text.contains("s3cr3t"), "{text}");
        assert!(
            text.contains("<redacted>") && text.contains("AKIAEXAMPLE"),
            "{text}"
        );
    }
}
