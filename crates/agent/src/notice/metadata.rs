//! The clouds' instance metadata services, asked as each provider documents it.

use std::collections::BTreeMap;
use std::time::Duration;

use stasis_core::notice::{self, Notice, Provider};

use super::act::now_unix_ms;

/// Where each provider's metadata service answers.
fn default_base(p: Provider) -> &'static str {
    match p {
        Provider::Aws | Provider::Azure => "http://169.254.169.254",
        Provider::Gcp => "http://metadata.google.internal",
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NoticeError {
    #[error("{provider} metadata service at {url}: {source}")]
    Http {
        provider: &'static str,
        url: String,
        source: reqwest::Error,
    },
    #[error("{provider} metadata service at {url} answered {status}")]
    Status {
        provider: &'static str,
        url: String,
        status: u16,
    },
    #[error(transparent)]
    Malformed(#[from] notice::MalformedAnswer),
}

/// Asks one provider's metadata service for notices.
pub struct MetadataClient {
    provider: Provider,
    pub(super) base: String,
    http: reqwest::Client,
    /// AWS IMDSv2 session token and when it was taken.
    aws_token: Option<(String, std::time::Instant)>,
    /// GCP: the ETag of each long-polled value, so `wait_for_change` waits for a new one.
    gcp_etags: BTreeMap<&'static str, String>,
    /// Azure: this VM's name (Scheduled Events name the VMs they affect).
    azure_vm: Option<String>,
}

const AWS_TOKEN_TTL_S: u64 = 21_600;
/// How long one GCP long poll waits for a change before asking again.
const GCP_WAIT_S: u64 = 20;

impl MetadataClient {
    pub fn new(provider: Provider, base: Option<&str>) -> Self {
        let http = reqwest::Client::builder()
            // The link-local service answers at once or not at all; GCP's long polls set
            // their own, longer timeout per request.
            .connect_timeout(Duration::from_secs(2))
            .no_proxy()
            .build()
            .expect("an HTTP client without TLS or proxy always builds");
        Self {
            provider,
            base: base
                .unwrap_or(default_base(provider))
                .trim_end_matches('/')
                .to_owned(),
            http,
            aws_token: None,
            gcp_etags: BTreeMap::new(),
            azure_vm: None,
        }
    }

    pub fn provider(&self) -> Provider {
        self.provider
    }

    /// Sends a request (headers, timeout) and reads the whole answer.
    async fn send(
        &self,
        method: reqwest::Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<String>,
        timeout: Duration,
    ) -> Result<Answer, NoticeError> {
        let mut req = self.http.request(method, url).timeout(timeout);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(b) = body {
            req = req.header("Content-Type", "application/json").body(b);
        }
        let http = |source| NoticeError::Http {
            provider: self.provider.name(),
            url: url.to_owned(),
            source,
        };
        let r = req.send().await.map_err(http)?;
        let status = r.status().as_u16();
        // Only an ETag of hex digits goes back into a URL.
        let etag = r
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .filter(|e| e.len() <= 64 && e.bytes().all(|b| b.is_ascii_hexdigit()))
            .map(str::to_owned);
        let body = r.text().await.map_err(http)?;
        Ok(Answer {
            url: url.to_owned(),
            status,
            etag,
            body,
        })
    }

    /// A GET whose answer must be a success.
    async fn get_ok(&self, url: &str, headers: &[(&str, &str)]) -> Result<Answer, NoticeError> {
        let a = self
            .send(
                reqwest::Method::GET,
                url,
                headers,
                None,
                Duration::from_secs(5),
            )
            .await?;
        self.success(a)
    }

    fn success(&self, a: Answer) -> Result<Answer, NoticeError> {
        if (200..300).contains(&a.status) {
            Ok(a)
        } else {
            Err(NoticeError::Status {
                provider: self.provider.name(),
                url: a.url,
                status: a.status,
            })
        }
    }

    /// One round: every notice the provider states now.
    pub async fn poll(&mut self) -> Result<Vec<Notice>, NoticeError> {
        match self.provider {
            Provider::Aws => self.poll_aws().await,
            Provider::Gcp => self.poll_gcp().await,
            Provider::Azure => self.poll_azure().await,
        }
    }

    async fn aws_token(&mut self) -> Result<String, NoticeError> {
        if let Some((t, at)) = &self.aws_token {
            if at.elapsed() < Duration::from_secs(AWS_TOKEN_TTL_S / 2) {
                return Ok(t.clone());
            }
        }
        let url = format!("{}/latest/api/token", self.base);
        let ttl = AWS_TOKEN_TTL_S.to_string();
        let a = self
            .send(
                reqwest::Method::PUT,
                &url,
                &[("X-aws-ec2-metadata-token-ttl-seconds", &ttl)],
                None,
                Duration::from_secs(5),
            )
            .await?;
        let t = self.success(a)?.body;
        self.aws_token = Some((t.clone(), std::time::Instant::now()));
        Ok(t)
    }

    /// An AWS metadata path: `Some(body)` on 200, `None` on 404 (nothing announced).
    async fn aws_get(&mut self, path: &str) -> Result<Option<String>, NoticeError> {
        let token = self.aws_token().await?;
        let url = format!("{}/latest/meta-data/{path}", self.base);
        let a = self
            .send(
                reqwest::Method::GET,
                &url,
                &[("X-aws-ec2-metadata-token", &token)],
                None,
                Duration::from_secs(5),
            )
            .await?;
        match a.status {
            404 => Ok(None),
            401 => {
                // The token expired or the service restarted: a new one next round.
                self.aws_token = None;
                self.success(a).map(|_| None)
            }
            _ => Ok(Some(self.success(a)?.body)),
        }
    }

    async fn poll_aws(&mut self) -> Result<Vec<Notice>, NoticeError> {
        let mut out = Vec::new();
        if let Some(b) = self.aws_get("spot/instance-action").await? {
            out.push(notice::aws_instance_action(&b)?);
        }
        if let Some(b) = self.aws_get("events/recommendations/rebalance").await? {
            out.push(notice::aws_rebalance(&b)?);
        }
        if let Some(b) = self.aws_get("events/maintenance/scheduled").await? {
            out.extend(notice::aws_scheduled_events(&b)?);
        }
        Ok(out)
    }

    /// A GCP value, long-polled: answers when it changes (or after [`GCP_WAIT_S`]).
    async fn gcp_get(&self, key: &str) -> Result<Answer, NoticeError> {
        let mut url = format!(
            "{}/computeMetadata/v1/instance/{key}?wait_for_change=true&timeout_sec={GCP_WAIT_S}",
            self.base
        );
        if let Some(e) = self.gcp_etags.get(key) {
            url.push_str("&last_etag=");
            url.push_str(e);
        }
        let a = self
            .send(
                reqwest::Method::GET,
                &url,
                &[("Metadata-Flavor", "Google")],
                None,
                Duration::from_secs(GCP_WAIT_S + 10),
            )
            .await?;
        self.success(a)
    }

    async fn poll_gcp(&mut self) -> Result<Vec<Notice>, NoticeError> {
        let now = now_unix_ms();
        // Both values long-polled at once; whichever changes first answers (the other request
        // is dropped and asked again next round, its last ETag unchanged).
        let (key, answer) = {
            let pre = self.gcp_get("preempted");
            let maint = self.gcp_get("maintenance-event");
            tokio::pin!(pre, maint);
            tokio::select! {
                r = &mut pre => ("preempted", r),
                r = &mut maint => ("maintenance-event", r),
            }
        };
        let a = answer?;
        if let Some(e) = a.etag {
            self.gcp_etags.insert(key, e);
        }
        Ok(if key == "preempted" {
            notice::gcp_preempted(&a.body, now)?.into_iter().collect()
        } else {
            notice::gcp_maintenance_event(&a.body)?
                .into_iter()
                .collect()
        })
    }

    fn azure_events_url(&self) -> String {
        format!(
            "{}/metadata/scheduledevents?api-version=2020-07-01",
            self.base
        )
    }

    async fn poll_azure(&mut self) -> Result<Vec<Notice>, NoticeError> {
        if self.azure_vm.is_none() {
            let url = format!(
                "{}/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                self.base
            );
            let name = self.get_ok(&url, &[("Metadata", "true")]).await?.body;
            self.azure_vm = Some(name.trim().to_owned());
        }
        let a = self
            .get_ok(&self.azure_events_url(), &[("Metadata", "true")])
            .await?;
        Ok(notice::azure_scheduled_events(
            &a.body,
            self.azure_vm.as_deref().unwrap_or_default(),
        )?)
    }

    /// Lets an Azure event start now (its checkpoints are done); nothing elsewhere.
    pub async fn acknowledge(&self, n: &Notice) -> Result<(), NoticeError> {
        if n.provider != Provider::Azure {
            return Ok(());
        }
        let body = serde_json::json!({"StartRequests": [{"EventId": n.id}]});
        let a = self
            .send(
                reqwest::Method::POST,
                &self.azure_events_url(),
                &[("Metadata", "true")],
                Some(body.to_string()),
                Duration::from_secs(5),
            )
            .await?;
        self.success(a).map(drop)
    }
}

/// A metadata service's answer, read whole.
#[derive(Debug)]
struct Answer {
    url: String,
    status: u16,
    etag: Option<String>,
    body: String,
}
