//! Layered, typed configuration (spec: architecture.md §5).
//!
//! `config/default.toml` (compiled in, so the documented defaults are the
//! real ones) → an optional file given with `--config` → environment
//! variables `ORBIT_EVENTS__SECTION__KEY`. Unknown keys are an error naming
//! the key.

use std::{path::Path, time::Duration};

use config::{Config, Environment, File, FileFormat};
use serde::{Deserialize, Serialize};

/// The compiled-in defaults, identical to `config/default.toml`.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// All settings of a node. Field names are the public configuration keys.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub server: ServerSettings,
    pub database: DatabaseSettings,
    pub limits: LimitSettings,
    pub timing: TimingSettings,
    pub retention: RetentionSettings,
}

/// `[server]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    /// `host:port`; port 0 picks a free port.
    pub listen: String,
    /// Exact `Origin` values allowed to open a WebSocket.
    pub allowed_origins: Vec<String>,
    /// `host:port` of a second listener for `/metrics` (with `/healthz` and
    /// `/readyz`); when set, the API listener answers `/metrics` with 404.
    /// `None`: `/metrics` is served on `listen`.
    #[serde(default)]
    pub metrics_listen: Option<String>,
    /// Serve the admin console at `/console/` (decision 0085).
    pub console: bool,
}

/// `[database]`.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseSettings {
    /// `sqlite://PATH?mode=rwc[&synchronous=full|normal]` or `postgres://...`.
    pub url: String,
    pub max_connections: u32,
}

impl std::fmt::Debug for DatabaseSettings {
    // The URL may carry a password: never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseSettings")
            .field("url", &redact_url(&self.url))
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

/// A database URL with any `user:password@` part replaced, for logs.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

/// `[limits]` (delivery-model.md §7).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSettings {
    pub max_connections: usize,
    pub claims_in_flight: usize,
    pub claims_in_flight_per_application: usize,
    pub claims_queued: usize,
    pub claims_per_scan_round: usize,
    pub read_queue: usize,
    pub write_queue: usize,
    pub max_subscriptions_per_namespace: u64,
}

/// `[timing]`, all in milliseconds.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TimingSettings {
    pub lease_ms: u64,
    pub heartbeat_interval_ms: u64,
    pub read_idle_timeout_ms: u64,
    pub write_timeout_ms: u64,
    /// 0: connections live until they fail (decision 0086).
    pub connection_lifetime_ms: u64,
    pub hello_timeout_ms: u64,
    pub http_request_timeout_ms: u64,
    pub scan_interval_ms: u64,
    pub sweep_interval_ms: u64,
}

impl TimingSettings {
    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }
    pub fn read_idle_timeout(&self) -> Duration {
        Duration::from_millis(self.read_idle_timeout_ms)
    }
    pub fn write_timeout(&self) -> Duration {
        Duration::from_millis(self.write_timeout_ms)
    }
    /// `None`: no lifetime limit.
    pub fn connection_lifetime(&self) -> Option<Duration> {
        (self.connection_lifetime_ms > 0)
            .then(|| Duration::from_millis(self.connection_lifetime_ms))
    }
    pub fn hello_timeout(&self) -> Duration {
        Duration::from_millis(self.hello_timeout_ms)
    }
    pub fn http_request_timeout(&self) -> Duration {
        Duration::from_millis(self.http_request_timeout_ms)
    }
    pub fn scan_interval(&self) -> Duration {
        Duration::from_millis(self.scan_interval_ms)
    }
    pub fn sweep_interval(&self) -> Duration {
        Duration::from_millis(self.sweep_interval_ms)
    }
}

/// `[retention]`, all in seconds.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionSettings {
    pub events_max_age_s: u64,
    pub acked_deliveries_max_age_s: u64,
    pub idempotency_max_age_s: u64,
}

/// Why the configuration could not be loaded; the message names the key.
#[derive(Debug, thiserror::Error)]
#[error("configuration error: {0}")]
pub struct SettingsError(String);

impl Settings {
    /// Loads defaults → `file` → environment. Errors name the offending key
    /// or file.
    pub fn load(file: Option<&Path>) -> Result<Settings, SettingsError> {
        Self::load_from(file, Environment::with_prefix("ORBIT_EVENTS"))
    }

    /// Every setting whose value differs from the compiled-in defaults, as
    /// `(key, value)` in file order (`("timing.lease_ms", "2000")`), the
    /// database URL without its password: what the start line shows.
    pub fn differences(&self) -> Vec<(String, String)> {
        let (Ok(ours), Ok(defaults)) = (
            serde_json::to_value(self),
            Settings::defaults()
                .and_then(|d| serde_json::to_value(d).map_err(|e| SettingsError(e.to_string()))),
        ) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let serde_json::Value::Object(sections) = ours else {
            return out;
        };
        for (section, keys) in sections {
            let serde_json::Value::Object(keys) = keys else {
                continue;
            };
            for (key, value) in keys {
                if defaults.get(&section).and_then(|s| s.get(&key)) == Some(&value) {
                    continue;
                }
                let name = format!("{section}.{key}");
                let shown = match value {
                    serde_json::Value::String(text) if name == "database.url" => redact_url(&text),
                    serde_json::Value::String(text) => text,
                    other => other.to_string(),
                };
                out.push((name, shown));
            }
        }
        out
    }

    /// The compiled-in defaults only (no file, no environment); used by tests.
    pub fn defaults() -> Result<Settings, SettingsError> {
        Self::build(Config::builder().add_source(File::from_str(DEFAULT_TOML, FileFormat::Toml)))
    }

    fn load_from(file: Option<&Path>, env: Environment) -> Result<Settings, SettingsError> {
        let mut builder =
            Config::builder().add_source(File::from_str(DEFAULT_TOML, FileFormat::Toml));
        if let Some(path) = file {
            if !path.is_file() {
                return Err(SettingsError(format!(
                    "config file {} does not exist",
                    path.display()
                )));
            }
            builder = builder.add_source(File::from(path).format(FileFormat::Toml));
        }
        builder = builder.add_source(
            env.prefix_separator("__")
                .separator("__")
                .list_separator(",")
                .with_list_parse_key("server.allowed_origins")
                .try_parsing(true),
        );
        Self::build(builder)
    }

    fn build(
        builder: config::ConfigBuilder<config::builder::DefaultState>,
    ) -> Result<Settings, SettingsError> {
        let config = builder
            .build()
            .map_err(|err| SettingsError(err.to_string()))?;
        let mut settings: Settings = config
            .try_deserialize()
            .map_err(|err| SettingsError(err.to_string()))?;
        // An empty environment value means "no origins", not one empty origin.
        settings.server.allowed_origins.retain(|o| !o.is_empty());
        settings.validate()?;
        Ok(settings)
    }

    fn validate(&self) -> Result<(), SettingsError> {
        let positive = [
            (
                "database.max_connections",
                self.database.max_connections as u64,
            ),
            ("limits.max_connections", self.limits.max_connections as u64),
            (
                "limits.claims_in_flight",
                self.limits.claims_in_flight as u64,
            ),
            (
                "limits.claims_in_flight_per_application",
                self.limits.claims_in_flight_per_application as u64,
            ),
            ("limits.claims_queued", self.limits.claims_queued as u64),
            (
                "limits.claims_per_scan_round",
                self.limits.claims_per_scan_round as u64,
            ),
            ("limits.read_queue", self.limits.read_queue as u64),
            ("limits.write_queue", self.limits.write_queue as u64),
            (
                "limits.max_subscriptions_per_namespace",
                self.limits.max_subscriptions_per_namespace,
            ),
            ("timing.lease_ms", self.timing.lease_ms),
            (
                "timing.heartbeat_interval_ms",
                self.timing.heartbeat_interval_ms,
            ),
            (
                "timing.read_idle_timeout_ms",
                self.timing.read_idle_timeout_ms,
            ),
            ("timing.write_timeout_ms", self.timing.write_timeout_ms),
            ("timing.hello_timeout_ms", self.timing.hello_timeout_ms),
            (
                "timing.http_request_timeout_ms",
                self.timing.http_request_timeout_ms,
            ),
            ("timing.scan_interval_ms", self.timing.scan_interval_ms),
            ("timing.sweep_interval_ms", self.timing.sweep_interval_ms),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(SettingsError(format!("{key} must be greater than 0")));
            }
        }
        // Consumers ping at the interval the welcome advertises; at or above
        // the read idle timeout every well-behaved connection would be
        // closed as idle (decision 0075).
        let (heartbeat, idle) = (
            self.timing.heartbeat_interval_ms,
            self.timing.read_idle_timeout_ms,
        );
        if heartbeat >= idle {
            return Err(SettingsError(format!(
                "timing.heartbeat_interval_ms ({heartbeat}) must be below \
                 timing.read_idle_timeout_ms ({idle}): consumers ping at the advertised \
                 heartbeat interval, and a connection silent for the read idle timeout is closed"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> Environment {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Environment::with_prefix("ORBIT_EVENTS").source(Some(map))
    }

    #[test]
    fn defaults_match_the_documented_values() {
        let s = Settings::defaults().unwrap();
        assert_eq!(s.server.listen, "127.0.0.1:8080");
        assert_eq!(s.limits.max_connections, 128);
        assert_eq!(s.timing.lease_ms, 30_000);
        assert_eq!(s.retention.events_max_age_s, 604_800);
    }

    #[test]
    fn environment_overrides_nested_keys_and_lists() {
        let s = Settings::load_from(
            None,
            env(&[
                ("ORBIT_EVENTS__TIMING__LEASE_MS", "500"),
                (
                    "ORBIT_EVENTS__SERVER__ALLOWED_ORIGINS",
                    "https://a.example,https://b.example",
                ),
            ]),
        )
        .unwrap();
        assert_eq!(s.timing.lease_ms, 500);
        assert_eq!(
            s.server.allowed_origins,
            vec![
                "https://a.example".to_owned(),
                "https://b.example".to_owned()
            ]
        );
    }

    #[test]
    fn an_unknown_environment_key_is_an_error_naming_it() {
        let err = Settings::load_from(None, env(&[("ORBIT_EVENTS__TIMING__LEASE_SECONDS", "5")]))
            .unwrap_err();
        assert!(err.to_string().contains("lease_seconds"), "{err}");
    }

    #[test]
    fn an_unknown_file_key_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("extra.toml");
        std::fs::write(&path, "[limits]\nmax_conections = 5\n").unwrap();
        let err = Settings::load_from(Some(&path), env(&[])).unwrap_err();
        assert!(err.to_string().contains("max_conections"), "{err}");
    }

    #[test]
    fn an_unknown_section_is_an_error_naming_it() {
        let err =
            Settings::load_from(None, env(&[("ORBIT_EVENTS__TIMEOUTS__X", "5")])).unwrap_err();
        assert!(err.to_string().contains("timeouts"), "{err}");
    }

    #[test]
    fn passwords_in_database_urls_are_redacted() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5432/db"),
            "postgres://***@h:5432/db"
        );
        assert_eq!(redact_url("sqlite://var/x.db"), "sqlite://var/x.db");
    }
}
