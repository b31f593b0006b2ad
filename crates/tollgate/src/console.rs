//! The operator console under `/console/`: a page and a hand-written script,
//! embedded in the binary, that call the admin API (`/v1/`) with the token
//! the operator typed at sign-in. The assets themselves hold no data and
//! need no token; everything they show comes from the API, behind it.
//!
//! Every answer carries a strict Content-Security-Policy (scripts and styles
//! from this origin only, no inline script, no form posting anywhere, no
//! framing), so a value that slipped past the script's escaping still could
//! not run.

use axum::Router;
use axum::http::header;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

const INDEX: &str = include_str!("../assets/console/index.html");
const SCRIPT: &str = include_str!("../assets/console/console.js");
const STYLE: &str = include_str!("../assets/console/console.css");

/// No inline script or style, calls to this origin only, forms go nowhere
/// (the script sends them), and no page may frame the console.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; form-action 'none'; frame-ancestors 'none'; \
     base-uri 'none'";

pub fn router() -> Router {
    Router::new()
        .route(
            "/console",
            get(|| async { Redirect::permanent("/console/") }),
        )
        .route(
            "/console/",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/console/console.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/console/console.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}
