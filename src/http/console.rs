//! `GET /console/`: the admin console, three static files embedded in the
//! binary (`src/http/console/`), a page over this node's own API. It
//! holds no data and needs no token to load; the page asks for one and
//! sends it only to the API. Decision 0085.

use actix_web::{
    HttpResponse,
    http::header::{self, HeaderValue},
    web,
};

use crate::{
    error::{Error, Result},
    state::AppState,
};

/// The page loads only from this node: scripts and styles are files (no
/// inline code), requests go to the same origin, nothing may frame it.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// (name, content type, content) of each file.
const FILES: [(&str, &str, &str); 4] = [
    (
        "index.html",
        "text/html; charset=utf-8",
        include_str!("console/index.html"),
    ),
    (
        "console.js",
        "text/javascript; charset=utf-8",
        include_str!("console/console.js"),
    ),
    (
        "console.css",
        "text/css; charset=utf-8",
        include_str!("console/console.css"),
    ),
    (
        "favicon.svg",
        "image/svg+xml",
        include_str!("console/favicon.svg"),
    ),
];

/// 404 `NOT_FOUND` when `server.console` is false: the console is then
/// absent, as if never built in.
fn enabled(state: &AppState) -> Result<()> {
    if state.settings.server.console {
        Ok(())
    } else {
        Err(Error::not_found("no such route"))
    }
}

/// `GET /console`: redirects (308) to `/console/`, where the page's
/// relative links resolve.
pub async fn root(state: web::Data<AppState>) -> Result<HttpResponse> {
    enabled(&state)?;
    Ok(HttpResponse::PermanentRedirect()
        .insert_header((header::LOCATION, "console/"))
        .finish())
}

/// `GET /console/{file}`: `index.html` (also for `/console/`),
/// `console.js`, `console.css` or `favicon.svg`, with the Content-Security-Policy,
/// `X-Frame-Options: DENY`, `X-Content-Type-Options: nosniff` and
/// `Referrer-Policy: no-referrer`; 404 `NOT_FOUND` for any other name.
pub async fn file(state: web::Data<AppState>, name: web::Path<String>) -> Result<HttpResponse> {
    enabled(&state)?;
    let name = match name.as_str() {
        "" => "index.html",
        other => other,
    };
    let (_, content_type, body) = FILES
        .iter()
        .find(|(file, _, _)| *file == name)
        .ok_or_else(|| Error::not_found("no such file of the console"))?;
    let mut res = HttpResponse::Ok();
    res.content_type(*content_type)
        .insert_header((
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ))
        .insert_header((header::X_FRAME_OPTIONS, "DENY"))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, "no-referrer"));
    Ok(res.body(*body))
}
