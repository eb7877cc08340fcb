//! Standard Webhooks signing: `webhook-signature: v1,<base64 HMAC-SHA256>` over
//! `"{webhook-id}.{webhook-timestamp}.{body}"`, keyed with the base64-decoded part of the
//! secret after `whsec_`.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use super::model::WebhookSecret;

/// The prefix Standard Webhooks secrets carry.
pub const SECRET_PREFIX: &str = "whsec_";

/// A fresh secret: `whsec_` + base64 of 24 bytes from the operating system's generator.
pub fn generate_secret() -> WebhookSecret {
    let mut key = [0u8; 24];
    rand::rngs::OsRng.fill_bytes(&mut key);
    WebhookSecret(format!("{SECRET_PREFIX}{}", STANDARD.encode(key)))
}

/// The `webhook-signature` header value for one attempt.
pub fn sign(secret: &WebhookSecret, id: &str, timestamp: i64, body: &str) -> String {
    let encoded = secret.0.strip_prefix(SECRET_PREFIX).unwrap_or(&secret.0);
    // Secrets are generated here, so they decode; a damaged one still signs (with its raw
    // bytes), and the receiver's verification tells its owner.
    let key = STANDARD
        .decode(encoded)
        .unwrap_or_else(|_| encoded.as_bytes().to_vec());
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes any key length");
    mac.update(format!("{id}.{timestamp}.{body}").as_bytes());
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_matches_the_standard_webhooks_reference_example() {
        // The example of the Standard Webhooks specification's reference libraries.
        let secret = WebhookSecret("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into());
        let body = r#"{"test": 2432232314}"#;
        assert_eq!(
            sign(&secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn generated_secrets_carry_24_random_bytes() {
        let a = generate_secret();
        let b = generate_secret();
        assert_ne!(a, b);
        let key = STANDARD
            .decode(a.0.strip_prefix(SECRET_PREFIX).unwrap())
            .unwrap();
        assert_eq!(key.len(), 24);
    }
}
