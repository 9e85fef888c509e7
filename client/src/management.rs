//! The management HTTP API as typed calls (spec: http-api.md).

use std::time::Duration;

use reqwest::{Method, StatusCode, Url, header};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::Value;

use crate::{
    credentials::{IdempotencyKey, Token},
    error::{ApiError, Error, ErrorCode},
    types::{
        ConfigureSubscription, CreateSubscription, DeliveryDetail, DeliveryHistory, DeliveryResult,
        DeliveryState, EventDelivery, Health, NewResult, Page, PublishResult, PublishResults,
        QueueList, RetryDelivery, RetryExpired, RetryReceipt, Subscription, SubscriptionResult,
        SubscriptionStatus,
    },
};

/// How long one request may take in all. The server answers within its own
/// 8 s deadline; the rest is for the network.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// A typed client of one node's management API. Cheap to clone; share one.
///
/// Every call returns the envelope's `data` as its type, or an [`Error`]:
/// [`Error::Api`] carries the service's [`ErrorCode`]. Writes take a
/// caller-supplied [`IdempotencyKey`]: to retry a write whose answer was
/// lost ([`Error::is_retryable`]), send it again with the same key.
#[derive(Clone, Debug)]
pub struct Client {
    base: Url,
    token: Token,
    http: reqwest::Client,
}

/// The list filters of `GET /v1/subscriptions/{id}/deliveries`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeliveryFilter {
    /// Only deliveries in this state.
    pub state: Option<DeliveryState>,
    /// Page size 1–100 (server default 20).
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

impl Client {
    /// A client of the node at `server` (e.g. `http://127.0.0.1:8080`),
    /// authenticating with `token`. Only `http://` is supported (decision
    /// 0050): put a TLS-terminating proxy in front of remote nodes.
    pub fn new(server: &str, token: Token) -> Result<Client, Error> {
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(Duration::from_secs(5))
            // A node closes a keep-alive connection after 5 s idle; a pooled
            // connection kept longer can be reused just as the node closes
            // it, and that request gets no answer. Idle ones go first.
            .pool_idle_timeout(Duration::from_secs(3))
            .build()
            .map_err(|e| Error::InvalidInput(format!("cannot build the HTTP client: {e}")))?;
        Client::with_http_client(server, token, http)
    }

    /// Like [`Client::new`] with a `reqwest::Client` of your own (timeouts,
    /// connection pool).
    pub fn with_http_client(
        server: &str,
        token: Token,
        http: reqwest::Client,
    ) -> Result<Client, Error> {
        Ok(Client {
            base: server_url(server)?,
            token,
            http,
        })
    }

    /// The node's base URL.
    pub fn server(&self) -> &Url {
        &self.base
    }

    /// The token this client presents.
    pub fn token(&self) -> &Token {
        &self.token
    }

    /// `POST /v1/subscriptions` (events:manage). 201 on first success, 200
    /// with `deduplicated: true` for a replay of the same key.
    pub async fn create_subscription(
        &self,
        key: &IdempotencyKey,
        request: &CreateSubscription,
    ) -> Result<SubscriptionResult, Error> {
        self.write(&["v1", "subscriptions"], key, request).await
    }

    /// `GET /v1/subscriptions?queue_id=…` (events:read): this credential's
    /// subscriptions on the queue, newest first.
    pub async fn list_subscriptions(
        &self,
        queue_id: &str,
        limit: Option<u32>,
        cursor: Option<&str>,
    ) -> Result<Page<Subscription>, Error> {
        let mut query = vec![("queue_id", queue_id.to_owned())];
        query.extend(limit.map(|l| ("limit", l.to_string())));
        query.extend(cursor.map(|c| ("cursor", c.to_owned())));
        self.read(&["v1", "subscriptions"], &query).await
    }

    /// `GET /v1/subscriptions/{id}` (events:read): the current state.
    pub async fn get_subscription(&self, id: &str) -> Result<Subscription, Error> {
        self.read(&["v1", "subscriptions", id], &[]).await
    }

    /// `POST /v1/subscriptions/{id}:configure` (events:manage): pause
    /// (`enabled: false`) or resume. `STATE_CONFLICT` when
    /// `expected_revision` is not the current revision.
    pub async fn configure_subscription(
        &self,
        id: &str,
        key: &IdempotencyKey,
        request: &ConfigureSubscription,
    ) -> Result<SubscriptionResult, Error> {
        let last = format!("{id}:configure");
        self.write(&["v1", "subscriptions", &last], key, request)
            .await
    }

    /// `GET /v1/subscriptions/{id}/deliveries` (events:read), newest first.
    pub async fn list_deliveries(
        &self,
        subscription_id: &str,
        filter: &DeliveryFilter,
    ) -> Result<Page<EventDelivery>, Error> {
        let mut query = Vec::new();
        query.extend(filter.state.map(|s| ("state", s.as_str().to_owned())));
        query.extend(filter.limit.map(|l| ("limit", l.to_string())));
        query.extend(filter.cursor.clone().map(|c| ("cursor", c)));
        self.read(
            &["v1", "subscriptions", subscription_id, "deliveries"],
            &query,
        )
        .await
    }

    /// `GET /v1/subscriptions/{id}/deliveries/{delivery_id}` (events:read):
    /// the delivery and its event.
    pub async fn get_delivery(
        &self,
        subscription_id: &str,
        delivery_id: &str,
    ) -> Result<DeliveryDetail, Error> {
        self.read(
            &[
                "v1",
                "subscriptions",
                subscription_id,
                "deliveries",
                delivery_id,
            ],
            &[],
        )
        .await
    }

    /// `POST .../deliveries/{delivery_id}:retry` (events:manage): re-arms an
    /// EXPIRED delivery with more attempts (`STATE_CONFLICT` otherwise).
    pub async fn retry_delivery(
        &self,
        subscription_id: &str,
        delivery_id: &str,
        key: &IdempotencyKey,
        request: &RetryDelivery,
    ) -> Result<DeliveryResult, Error> {
        let last = format!("{delivery_id}:retry");
        self.write(
            &["v1", "subscriptions", subscription_id, "deliveries", &last],
            key,
            request,
        )
        .await
    }

    /// `GET /v1/subscriptions/{id}/status` (events:read): position, backlog,
    /// sessions and why nothing moves (`blocked`, empty when it moves).
    pub async fn subscription_status(&self, id: &str) -> Result<SubscriptionStatus, Error> {
        self.read(&["v1", "subscriptions", id, "status"], &[]).await
    }

    /// `GET .../deliveries/{delivery_id}/history` (events:read): every step
    /// of the delivery, oldest first.
    pub async fn delivery_history(
        &self,
        subscription_id: &str,
        delivery_id: &str,
    ) -> Result<DeliveryHistory, Error> {
        self.read(
            &[
                "v1",
                "subscriptions",
                subscription_id,
                "deliveries",
                delivery_id,
                "history",
            ],
            &[],
        )
        .await
    }

    /// `POST /v1/subscriptions/{id}/deliveries:retry` (events:manage):
    /// re-arms the EXPIRED deliveries of a sequence range (a dry run counts
    /// them only).
    pub async fn retry_expired(
        &self,
        subscription_id: &str,
        key: &IdempotencyKey,
        request: &RetryExpired,
    ) -> Result<RetryReceipt, Error> {
        self.write(
            &["v1", "subscriptions", subscription_id, "deliveries:retry"],
            key,
            request,
        )
        .await
    }

    /// `GET /v1/queues` (events:read): the queues of the credential's scope.
    pub async fn list_queues(&self) -> Result<QueueList, Error> {
        self.read(&["v1", "queues"], &[]).await
    }

    /// `POST /v1/queues/{queue_id}/results` (results:publish): appends 1–100
    /// results atomically, in order.
    pub async fn publish_results(
        &self,
        queue_id: &str,
        key: &IdempotencyKey,
        results: &[NewResult],
    ) -> Result<PublishResult, Error> {
        self.write(
            &["v1", "queues", queue_id, "results"],
            key,
            &PublishResults { results },
        )
        .await
    }

    /// `GET /healthz` (no auth): the process answers.
    pub async fn healthz(&self) -> Result<Health, Error> {
        decode(
            self.request(Method::GET, &["healthz"], &[], None)
                .send()
                .await,
        )
        .await
    }

    /// `GET /readyz` (no auth): the node can reach its database.
    pub async fn readyz(&self) -> Result<Health, Error> {
        decode(
            self.request(Method::GET, &["readyz"], &[], None)
                .send()
                .await,
        )
        .await
    }

    async fn read<T: DeserializeOwned>(
        &self,
        path: &[&str],
        query: &[(&str, String)],
    ) -> Result<T, Error> {
        let request = self.request(Method::GET, path, query, Some(&self.token));
        decode(request.send().await).await
    }

    async fn write<T: DeserializeOwned, B: Serialize>(
        &self,
        path: &[&str],
        key: &IdempotencyKey,
        body: &B,
    ) -> Result<T, Error> {
        let body = serde_json::to_vec(body)
            .map_err(|e| Error::InvalidInput(format!("cannot encode the request: {e}")))?;
        let request = self
            .request(Method::POST, path, &[], Some(&self.token))
            .header("Idempotency-Key", key.as_str())
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        decode(request.send().await).await
    }

    fn request(
        &self,
        method: Method,
        path: &[&str],
        query: &[(&str, String)],
        token: Option<&Token>,
    ) -> reqwest::RequestBuilder {
        let mut url = self.base.clone();
        if let Ok(mut segments) = url.path_segments_mut() {
            // Each part is one percent-encoded segment: an id can never
            // change the route.
            segments.pop_if_empty().extend(path);
        }
        if !query.is_empty() {
            url.query_pairs_mut()
                .extend_pairs(query.iter().map(|(k, v)| (*k, v.as_str())));
        }
        let mut request = self.http.request(method, url);
        if let Some(token) = token {
            request = request.header(header::AUTHORIZATION, token.bearer());
        }
        request
    }
}

/// Parses and checks a node's base URL: `http://host[:port][/prefix]`,
/// without query or fragment.
pub(crate) fn server_url(server: &str) -> Result<Url, Error> {
    let url = Url::parse(server).map_err(|e| {
        Error::InvalidInput(format!(
            "{server:?} is not a server URL ({e}); expected e.g. http://127.0.0.1:8080"
        ))
    })?;
    if url.scheme() != "http" {
        return Err(Error::InvalidInput(format!(
            "{server:?}: only http:// servers are supported (put a TLS-terminating proxy in \
             front of a remote node)"
        )));
    }
    if url.query().is_some() || url.fragment().is_some() || url.cannot_be_a_base() {
        return Err(Error::InvalidInput(format!(
            "{server:?}: a server URL has no query or fragment"
        )));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(Error::InvalidInput(
            "a server URL carries no credentials: the token comes from the environment".to_owned(),
        ));
    }
    Ok(url)
}

/// The envelope's `data`, or the error it carries.
async fn decode<T: DeserializeOwned>(
    sent: Result<reqwest::Response, reqwest::Error>,
) -> Result<T, Error> {
    let response = sent.map_err(transport)?;
    let status = response.status();
    let retry_after = response
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_secs);
    let text = response.text().await.map_err(transport)?;
    if status.is_success() {
        #[derive(serde::Deserialize)]
        struct Envelope<T> {
            data: T,
        }
        return serde_json::from_str::<Envelope<T>>(&text)
            .map(|e| e.data)
            .map_err(|e| Error::Protocol(format!("{status}: {e}")));
    }
    Err(api_error(status, &text, retry_after).into())
}

/// An error envelope as an [`ApiError`]; a body that is not one (a proxy's
/// page) keeps the status with a code from the status table.
pub(crate) fn api_error(status: StatusCode, text: &str, retry_after: Option<Duration>) -> ApiError {
    #[derive(serde::Deserialize)]
    struct ErrorEnvelope {
        request_id: Option<String>,
        error: ErrorBody,
    }
    #[derive(serde::Deserialize)]
    struct ErrorBody {
        code: ErrorCode,
        message: String,
        details: Option<Value>,
    }
    match serde_json::from_str::<ErrorEnvelope>(text) {
        Ok(e) => ApiError {
            status: Some(status.as_u16()),
            code: e.error.code,
            message: e.error.message,
            details: e.error.details,
            request_id: e.request_id,
            retry_after,
        },
        Err(_) => ApiError {
            status: Some(status.as_u16()),
            code: match status.as_u16() {
                401 => ErrorCode::Unauthenticated,
                403 => ErrorCode::PermissionDenied,
                404 => ErrorCode::NotFound,
                426 => ErrorCode::ProtocolRequired,
                429 => ErrorCode::CapacityExceeded,
                s if s >= 500 => ErrorCode::Unavailable,
                _ => ErrorCode::InvalidArgument,
            },
            message: format!("HTTP {status} without an error envelope"),
            details: None,
            request_id: None,
            retry_after,
        },
    }
}

fn transport(e: reqwest::Error) -> Error {
    // reqwest's message names the URL, which never carries a secret here.
    Error::Transport(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_urls_are_plain_http_without_query_or_credentials() {
        assert!(server_url("http://127.0.0.1:8080").is_ok());
        assert!(server_url("http://localhost:8080/prefix/").is_ok());
        for bad in [
            "127.0.0.1:8080",
            "https://example.test",
            "http://h/?x=1",
            "http://user:pw@h",
            "not a url",
        ] {
            assert!(server_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ids_in_paths_are_single_percent_encoded_segments() {
        let client = Client::new("http://127.0.0.1:1/base/", Token::new("t").unwrap()).unwrap();
        let request = client
            .request(
                Method::GET,
                &["v1", "subscriptions", "../x?y", "deliveries"],
                &[("state", "ACKED".to_owned())],
                None,
            )
            .build()
            .unwrap();
        assert_eq!(
            request.url().as_str(),
            "http://127.0.0.1:1/base/v1/subscriptions/..%2Fx%3Fy/deliveries?state=ACKED"
        );
    }

    #[test]
    fn an_error_body_that_is_not_an_envelope_keeps_its_status() {
        let e = api_error(StatusCode::BAD_GATEWAY, "<html>", None);
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert_eq!(e.status, Some(502));
        let e = api_error(
            StatusCode::CONFLICT,
            r#"{"request_id":"r","error":{"code":"STATE_CONFLICT","message":"m"}}"#,
            None,
        );
        assert_eq!(e.code, ErrorCode::StateConflict);
        assert_eq!(e.request_id.as_deref(), Some("r"));
    }
}
