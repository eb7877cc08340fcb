//! The web console at `/console`: one page, one script and one stylesheet, embedded in the binary
//! (no build step, no external network). The script signs in with an API token kept in the
//! tab's `sessionStorage` and drives the same JSON API as every other client.

use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

const PAGE: &str = include_str!("assets/index.html");
const SCRIPT: &str = include_str!("assets/console.js");
const STYLE: &str = include_str!("assets/console.css");

/// Only the console's own files: no inline script, no other origin, never framed (the page
/// holds a token).
const POLICY: &str = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

/// `/console` and its two assets.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/console", get(page))
        .route("/console/{file}", get(asset))
}

async fn page() -> Response {
    serve("text/html; charset=utf-8", PAGE)
}

async fn asset(Path(file): Path<String>) -> Response {
    match file.as_str() {
        "" | "index.html" => serve("text/html; charset=utf-8", PAGE),
        "console.js" => serve("text/javascript; charset=utf-8", SCRIPT),
        "console.css" => serve("text/css; charset=utf-8", STYLE),
        _ => (StatusCode::NOT_FOUND, "not found\n").into_response(),
    }
}

fn serve(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(POLICY),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_page_and_its_assets_are_served_with_their_types() {
        let answers = [
            (page().await, "text/html"),
            (asset(Path("console.js".into())).await, "text/javascript"),
            (asset(Path("console.css".into())).await, "text/css"),
        ];
        for (answer, kind) in answers {
            assert_eq!(answer.status(), StatusCode::OK, "{kind}");
            let got = answer.headers()[header::CONTENT_TYPE].to_str().unwrap();
            assert!(got.starts_with(kind), "{kind}: {got}");
            assert!(answer
                .headers()
                .contains_key(header::CONTENT_SECURITY_POLICY));
        }
        let missing = asset(Path("other.js".into())).await;
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    }

    #[test]
    fn nothing_is_loaded_from_another_origin() {
        assert!(PAGE.contains("/console/console.js") && PAGE.contains("/console/console.css"));
        assert!(!PAGE.contains("http") && !STYLE.contains("http"));
        // The one absolute URL in the script is the SVG namespace, which is never fetched.
        let svg = "http://www.w3.org/2000/svg";
        assert_eq!(SCRIPT.matches("http").count(), SCRIPT.matches(svg).count());
    }
}
