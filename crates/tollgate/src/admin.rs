//! The admin API under `/v1/`: the same operations as `tollgate quota`,
//! `tollgate tenant` and `tollgate cancel`, for tools, dashboards and the
//! console (`/console/`, served beside it). Every
//! endpoint needs `Authorization: Bearer $TOLLGATE_ADMIN_TOKEN` (compared in
//! constant time); with no token configured the API refuses everything. A
//! token shorter than [`AdminToken::MIN_BYTES`] cannot be built, so an empty
//! `TOLLGATE_ADMIN_TOKEN=` can never open the API.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tollgate_core::Adaptive;
use tollgate_core::{IdempotencyKey, JobId, Kind, Quota, TenantId, UnixMillis};
use tollgate_quota::{Actor, Cancel, Change, QuotaStore, Settings, Target};
use tollgate_runtime::baseline::AdaptiveEntry;

use crate::config::Config;

use tollgate_core::Secret;

/// Request bodies are tiny; anything larger is refused before parsing.
const BODY_LIMIT: usize = 16 * 1024;

/// The admin API's bearer token: at least [`AdminToken::MIN_BYTES`] long.
#[derive(Clone, Debug)]
pub struct AdminToken(Secret);

impl AdminToken {
    /// Shorter tokens (an empty one above all) are refused: 16 bytes is the
    /// least a random token worth the name has (`openssl rand -hex 16` gives 32).
    pub const MIN_BYTES: usize = 16;

    pub fn new(secret: Secret) -> Result<Self, String> {
        let len = secret.expose().len();
        if len < Self::MIN_BYTES {
            return Err(format!(
                "the admin token is {len} bytes; it must be at least {} \
                 (generate one with `openssl rand -hex 32`), or unset it to disable the admin API",
                Self::MIN_BYTES
            ));
        }
        Ok(Self(secret))
    }

    fn matches(&self, presented: &str) -> bool {
        constant_time_eq(presented.as_bytes(), self.0.expose().as_bytes())
    }
}

#[derive(Clone)]
pub struct AdminState {
    pub store: Arc<QuotaStore>,
    pub token: Option<AdminToken>,
    /// The default quota shown when none is stored, how long a cancel
    /// lasts, and where the dead-letter queue is.
    pub config: Arc<Config>,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/v1/quotas", get(list))
        .route("/v1/shared-quotas", get(list_shared))
        .route("/v1/console/tenants", get(tenant_page))
        .route("/v1/default-quota", get(get_default).put(put_default))
        .route(
            "/v1/tenants/{tenant}/quota",
            get(get_tenant).put(put_tenant).delete(delete_tenant),
        )
        .route(
            "/v1/tenants/{tenant}/shadow",
            put(put_shadow).delete(delete_shadow),
        )
        .route("/v1/tenants/{tenant}/weight", put(put_weight))
        .route("/v1/tenants/{tenant}/pause", post(pause))
        .route("/v1/tenants/{tenant}/resume", post(resume))
        .route(
            "/v1/routes/{route}/quota",
            get(get_route).put(put_route).delete(delete_route),
        )
        .route("/v1/history", get(history))
        .route("/v1/cancel", post(cancel))
        .route("/v1/dlq", get(dlq))
        .route("/v1/dlq/replay", post(dlq_replay))
        .route("/v1/dlq/purge", post(dlq_purge))
        .route("/v1/{*rest}", any(no_such_endpoint))
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state)
        .merge(crate::console::router())
}

/// An API path that does not exist: 404 with `{"error"}`, as the API's
/// other refusals (axum's is an empty body).
async fn no_such_endpoint(method: Method, uri: Uri) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        format!("no endpoint {method} {}", uri.path()),
    )
}

/// An API path asked with a method it does not take: 405 with `{"error"}`.
async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} does not take {method}", uri.path()),
    )
}

/// Compares without an early exit, so the time taken does not reveal how
/// much of a guess was right.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= usize::from(x ^ y);
    }
    diff == 0
}

async fn authorize(State(state): State<AdminState>, request: Request, next: Next) -> Response {
    let Some(token) = &state.token else {
        return unauthorized("the admin API is disabled: set TOLLGATE_ADMIN_TOKEN");
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
        .unwrap_or("");
    if !token.matches(presented) {
        return unauthorized("missing or wrong bearer token");
    }
    next.run(request).await
}

/// The credentials of a `Bearer` authorization (the scheme is
/// case-insensitive, RFC 9110 §11.1).
fn bearer(authorization: &str) -> Option<&str> {
    let (scheme, credentials) = authorization.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| credentials.trim_start())
}

fn unauthorized(message: &str) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        Json(json!({ "error": message })),
    )
        .into_response()
}

/// An error a client can act on.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

fn bad_request(e: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, format!("{e:#}"))
}

impl From<tollgate_quota::QuotaError> for ApiError {
    fn from(e: tollgate_quota::QuotaError) -> Self {
        let status = match e {
            tollgate_quota::QuotaError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, e.to_string())
    }
}

type ApiResult = Result<Response, ApiError>;

/// Who makes a change: `X-Tollgate-Actor` (for humans behind a tool; UTF-8,
/// 1 to 64 characters), recorded as `api:<actor>`, or `console:<actor>` when
/// the call comes from the console (`X-Tollgate-Client: console`), which
/// goes through the same endpoints. Without the header, `api:unknown`; a
/// name that cannot be recorded as sent is refused, not recorded as
/// `unknown`.
struct By(Actor);

impl<S: Send + Sync> FromRequestParts<S> for By {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let source = match parts.headers.get("x-tollgate-client").map(|v| v.as_bytes()) {
            Some(b"console") => "console",
            _ => "api",
        };
        let name = match parts.headers.get("x-tollgate-actor") {
            None => "unknown",
            Some(v) => std::str::from_utf8(v.as_bytes())
                .map_err(|_| bad_request("X-Tollgate-Actor must be UTF-8"))?,
        };
        Actor::named(source, name)
            .map(By)
            .map_err(|e| bad_request(format!("X-Tollgate-Actor {e}")))
    }
}

/// A JSON body, refused as every other bad input is: 400 (413 when too
/// large) with `{"error": …}`, not axum's plain-text 415 or 422.
struct Body<T>(T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(body)) => Ok(Body(body)),
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError(e.status(), e.body_text()))
            }
            Err(e) => Err(bad_request(e.body_text())),
        }
    }
}

/// Query parameters, refused like a bad [`Body`].
struct Params<T>(T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Params<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| Params(q))
            .map_err(|e| bad_request(e.body_text()))
    }
}

#[derive(Serialize)]
struct QuotaJson {
    rate: String,
    burst: u32,
}

impl From<Quota> for QuotaJson {
    fn from(q: Quota) -> Self {
        Self {
            rate: q.rate.to_string(),
            burst: q.burst,
        }
    }
}

fn settings_json(s: &Settings) -> serde_json::Value {
    json!({
        "quota": s.quota.map(QuotaJson::from),
        "adaptive": s.adaptive.map(|a| json!({
            "min": a.min.to_string(),
            "decrease": a.decrease,
            "increase": a.increase,
            "probe_s": a.probe.as_secs_f64(),
        })),
        "effective_rate_per_s": s.effective,
        "concurrency": s.concurrency,
        "weight": s.weight.unwrap_or(1),
        "paused": s.paused,
        "shadow": s.shadow.map(QuotaJson::from),
        "updated_by": s.updated_by,
        "updated_at": s.updated_at_ms.map(|t| UnixMillis(t).to_string()),
    })
}

fn tenant(name: &str) -> Result<Target, ApiError> {
    TenantId::parse(name)
        .map(Target::Tenant)
        .map_err(bad_request)
}

fn route(name: &str) -> Result<Target, ApiError> {
    Kind::parse(name).map(Target::Route).map_err(bad_request)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaBody {
    rate: String,
    #[serde(default = "tollgate_core::default_burst")]
    burst: u32,
    #[serde(default)]
    concurrency: Option<u32>,
    #[serde(default)]
    weight: Option<u32>,
    /// Present (`{}` for the defaults) when the rate is a ceiling and the
    /// quota learns the provider's limit.
    #[serde(default)]
    adaptive: Option<AdaptiveEntry>,
}

impl QuotaBody {
    /// For a default or route quota: no tenant-only settings.
    fn shared(&self) -> Result<Quota, ApiError> {
        if self.concurrency.is_some() {
            return Err(bad_request("concurrency applies to tenants"));
        }
        if self.weight.is_some() {
            return Err(bad_request("weight applies to tenants"));
        }
        Quota::parse(&self.rate, self.burst).map_err(bad_request)
    }

    fn adaptive(&self, quota: Quota) -> Result<Option<Adaptive>, ApiError> {
        self.adaptive
            .as_ref()
            .map(|a| a.parse(quota.rate))
            .transpose()
            .map_err(bad_request)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WeightBody {
    weight: u32,
}

async fn apply(state: &AdminState, target: &Target, change: Change, actor: &Actor) -> ApiResult {
    let (old, new) = state.store.apply(target, change, actor).await?;
    Ok(Json(json!({
        "target": target.label(),
        "action": change.action(),
        "old": settings_json(&old),
        "new": settings_json(&new),
    }))
    .into_response())
}

async fn show(state: &AdminState, target: &Target) -> ApiResult {
    match state.store.get(target).await? {
        Some(s) => Ok(Json(settings_json(&s)).into_response()),
        None => Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("nothing stored for {}", target.label()),
        )),
    }
}

async fn list(State(state): State<AdminState>) -> ApiResult {
    let tenants: serde_json::Map<String, serde_json::Value> = state
        .store
        .tenants()
        .await?
        .iter()
        .map(|(t, s)| (t.to_string(), settings_json(s)))
        .collect();
    let mut all = shared_json(&state).await?;
    all["tenants"] = tenants.into();
    Ok(Json(all).into_response())
}

/// The quotas tenants share: the default and the routes' (the console's
/// list of them; `/v1/quotas` without its tenants, which may be thousands).
async fn list_shared(State(state): State<AdminState>) -> ApiResult {
    Ok(Json(shared_json(&state).await?).into_response())
}

async fn shared_json(state: &AdminState) -> Result<serde_json::Value, ApiError> {
    let routes: serde_json::Map<String, serde_json::Value> = state
        .store
        .routes()
        .await?
        .iter()
        .map(|(r, s)| (r.to_string(), settings_json(s)))
        .collect();
    Ok(json!({
        "default": default_json(state).await?,
        "routes": routes,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PageQuery {
    #[serde(default)]
    prefix: String,
    #[serde(default)]
    offset: usize,
    limit: Option<usize>,
    /// `name` (the default) or `behind`: the tenants whose line of waiting
    /// jobs reaches furthest ahead first, then those a Retry-After holds.
    sort: Option<String>,
}

/// The console's tenant list: one page of the tenants with a stored quota
/// or recent traffic, by name or most behind first, filtered by prefix, each with what it is
/// doing fleet-wide ([`tollgate_quota::Activity`]) and why it waits.
async fn tenant_page(State(state): State<AdminState>, Params(q): Params<PageQuery>) -> ApiResult {
    let limit = q.limit.unwrap_or(50).clamp(1, 500);
    let mut names = state.store.tenant_names(&q.prefix).await?;
    let total = names.len();
    let mut activity = match q.sort.as_deref().unwrap_or("name") {
        "name" => {
            names = names.into_iter().skip(q.offset).take(limit).collect();
            state.store.activity(&names).await?
        }
        "behind" => {
            // Every matching tenant's activity, in one round trip, to sort.
            let all = state.store.activity(&names).await?;
            let mut rows: Vec<_> = names.into_iter().zip(all).collect();
            rows.sort_by(|(a_name, a), (b_name, b)| {
                b.queued_for_s
                    .total_cmp(&a.queued_for_s)
                    .then(b.retry_after_s.total_cmp(&a.retry_after_s))
                    .then(a_name.cmp(b_name))
            });
            let (page_names, page): (Vec<_>, Vec<_>) =
                rows.into_iter().skip(q.offset).take(limit).unzip();
            names = page_names;
            page
        }
        other => return Err(bad_request(format!("sort {other:?} is not name or behind"))),
    };
    let mut tenants = Vec::with_capacity(names.len());
    for (name, activity) in names.iter().zip(activity.drain(..)) {
        // A tenant with traffic and nothing stored runs on the default.
        let settings = state
            .store
            .get(&Target::Tenant(name.clone()))
            .await?
            .unwrap_or_default();
        let mut row = settings_json(&settings);
        row["tenant"] = name.to_string().into();
        row["waiting"] = activity.why_waiting(&settings).into();
        row["activity"] = json!({
            "sent_per_s_10s": activity.sent_per_s_10s,
            "sent_per_s_5m": activity.sent_per_s_5m,
            "throttled_5m": activity.throttled_5m,
            "failed_5m": activity.failed_5m,
            "in_flight": activity.in_flight,
            "queued": activity.queued,
            "queued_for_s": activity.queued_for_s,
            "parked": activity.parked.iter().map(|(r, n)| (r.as_str().to_owned(), json!(n))).collect::<serde_json::Map<_, _>>(),
            "retry_after_s": activity.retry_after_s,
            "due_lag_p95_s": activity.due_lag_p95_s.map(|s| if s.is_finite() { json!(s) } else { json!("over 10 s") }),
        });
        tenants.push(row);
    }
    Ok(Json(json!({
        "total": total,
        "offset": q.offset,
        "limit": limit,
        "tenants": tenants,
        "default": default_json(&state).await?,
    }))
    .into_response())
}

async fn default_json(state: &AdminState) -> Result<serde_json::Value, ApiError> {
    Ok(
        match state
            .store
            .get(&Target::Default)
            .await?
            .and_then(|s| s.quota)
        {
            Some(q) => json!({ "quota": QuotaJson::from(q), "source": "stored" }),
            None => {
                let fallback = state.config.default_quota().map_err(bad_request)?;
                json!({ "quota": QuotaJson::from(fallback), "source": "config" })
            }
        },
    )
}

async fn get_default(State(state): State<AdminState>) -> ApiResult {
    Ok(Json(default_json(&state).await?).into_response())
}

async fn put_default(
    State(state): State<AdminState>,
    By(actor): By,
    Body(body): Body<QuotaBody>,
) -> ApiResult {
    if body.adaptive.is_some() {
        return Err(bad_request(tollgate_core::adaptive::NOT_FOR_DEFAULT));
    }
    let change = Change::SetQuota {
        quota: body.shared()?,
        concurrency: None,
        weight: None,
        adaptive: None,
    };
    apply(&state, &Target::Default, change, &actor).await
}

async fn get_tenant(State(state): State<AdminState>, Path(name): Path<String>) -> ApiResult {
    show(&state, &tenant(&name)?).await
}

async fn put_tenant(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    By(actor): By,
    Body(body): Body<QuotaBody>,
) -> ApiResult {
    let quota = Quota::parse(&body.rate, body.burst).map_err(bad_request)?;
    let weight = body
        .weight
        .map(tollgate_core::weight)
        .transpose()
        .map_err(bad_request)?;
    let concurrency = body
        .concurrency
        .map(tollgate_core::concurrency)
        .transpose()
        .map_err(bad_request)?;
    let change = Change::SetQuota {
        quota,
        concurrency,
        weight,
        adaptive: body.adaptive(quota)?,
    };
    apply(&state, &tenant(&name)?, change, &actor).await
}

async fn put_weight(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    By(actor): By,
    Body(body): Body<WeightBody>,
) -> ApiResult {
    let weight = tollgate_core::weight(body.weight).map_err(bad_request)?;
    apply(&state, &tenant(&name)?, Change::SetWeight(weight), &actor).await
}

async fn delete_tenant(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    By(actor): By,
) -> ApiResult {
    delete(&state, &tenant(&name)?, &actor).await
}

/// A delete, saying when the quota baseline names the target (the delete
/// stands until the baseline's entry changes).
async fn delete(state: &AdminState, target: &Target, actor: &Actor) -> ApiResult {
    let (old, new) = state.store.apply(target, Change::Delete, actor).await?;
    let mut body = json!({
        "target": target.label(),
        "action": Change::Delete.action(),
        "old": settings_json(&old),
        "new": settings_json(&new),
    });
    if state.store.in_baseline(target).await? {
        body["note"] = crate::cli::BASELINE_DELETE_NOTE
            .replace("{target}", &target.label())
            .into();
    }
    Ok(Json(body).into_response())
}

async fn put_shadow(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    By(actor): By,
    Body(body): Body<QuotaBody>,
) -> ApiResult {
    let quota = Quota::parse(&body.rate, body.burst).map_err(bad_request)?;
    apply(&state, &tenant(&name)?, Change::SetShadow(quota), &actor).await
}

async fn delete_shadow(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    By(actor): By,
) -> ApiResult {
    apply(&state, &tenant(&name)?, Change::ClearShadow, &actor).await
}

async fn pause(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    By(actor): By,
) -> ApiResult {
    apply(&state, &tenant(&name)?, Change::Pause, &actor).await
}

async fn resume(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    By(actor): By,
) -> ApiResult {
    apply(&state, &tenant(&name)?, Change::Resume, &actor).await
}

async fn get_route(State(state): State<AdminState>, Path(name): Path<String>) -> ApiResult {
    show(&state, &route(&name)?).await
}

async fn put_route(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    By(actor): By,
    Body(body): Body<QuotaBody>,
) -> ApiResult {
    let quota = body.shared()?;
    let change = Change::SetQuota {
        quota,
        concurrency: None,
        weight: None,
        adaptive: body.adaptive(quota)?,
    };
    apply(&state, &route(&name)?, change, &actor).await
}

async fn delete_route(
    State(state): State<AdminState>,
    Path(name): Path<String>,
    By(actor): By,
) -> ApiResult {
    delete(&state, &route(&name)?, &actor).await
}

#[derive(Deserialize)]
struct HistoryQuery {
    /// `tenant:acme`, `route:email`, `default`; absent = everything.
    target: Option<String>,
    limit: Option<usize>,
}

async fn history(State(state): State<AdminState>, Params(q): Params<HistoryQuery>) -> ApiResult {
    let target = match q.target.as_deref() {
        None => None,
        Some("default") => Some(Target::Default),
        Some(t) => Some(match t.split_once(':') {
            Some(("tenant", name)) => tenant(name)?,
            Some(("route", name)) => route(name)?,
            _ => {
                return Err(bad_request(
                    "target is tenant:<name>, route:<kind> or default",
                ));
            }
        }),
    };
    let entries = state
        .store
        .history(target.as_ref(), q.limit.unwrap_or(50).min(1000))
        .await?;
    let out: Vec<_> = entries
        .iter()
        .map(|e| {
            json!({
                "at": UnixMillis(e.at_ms).to_string(),
                "target": e.target,
                "action": e.action,
                "who": e.who,
                "source": e.source,
                "old": settings_json(&e.old),
                "new": settings_json(&e.new),
                "detail": e.detail,
            })
        })
        .collect();
    Ok(Json(out).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    tenant: String,
    job_id: Option<String>,
    idempotency_key: Option<String>,
}

async fn cancel(
    State(state): State<AdminState>,
    By(actor): By,
    Body(body): Body<CancelBody>,
) -> ApiResult {
    let tenant = TenantId::parse(body.tenant.as_str()).map_err(bad_request)?;
    let by = match (body.job_id, body.idempotency_key) {
        (Some(id), None) => Cancel::JobId(JobId::parse(id).map_err(bad_request)?),
        (None, Some(key)) => Cancel::Key(IdempotencyKey::parse(key).map_err(bad_request)?),
        _ => {
            return Err(bad_request(
                "give exactly one of job_id and idempotency_key",
            ));
        }
    };
    state
        .store
        .cancel(
            &tenant,
            &by,
            Duration::from_secs(state.config.cancel_ttl_s),
            &actor,
        )
        .await?;
    Ok((
        StatusCode::OK,
        Json(json!({ "cancelled": by.to_string(), "tenant": tenant.as_str() })),
    )
        .into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DlqQuery {
    limit: Option<usize>,
    scan: Option<usize>,
}

/// The dead-letter queue as `tollgate dlq list` shows it (payloads left
/// out: they may hold personal data).
async fn dlq(State(state): State<AdminState>, Params(q): Params<DlqQuery>) -> ApiResult {
    let scan = q.scan.unwrap_or(10_000).min(100_000);
    let Some(read) = in_time(&state, crate::cli::dlq_summary(&state.config, scan)).await else {
        return Err(ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "reading up to {scan} dead letters takes longer than a request may last; the \
                 read goes on to its end and leaves every letter where it was. Read fewer \
                 (?scan=…), or run `tollgate dlq list`"
            ),
        ));
    };
    let summary = read.map_err(unavailable)?;
    let counts: Vec<_> = summary
        .counts
        .iter()
        .map(|((reason, tenant), n)| json!({"reason": reason, "tenant": tenant, "count": n}))
        .collect();
    let newest: Vec<_> = summary
        .newest
        .iter()
        .take(q.limit.unwrap_or(20).min(1000))
        .map(|l| {
            json!({
                "dead_at": l.dead_at.map(|t| t.to_string()),
                "reason": l.reason,
                "tenant": l.tenant,
                "job_id": l.job_id,
                "detail": l.detail,
            })
        })
        .collect();
    Ok(Json(json!({
        "queue": summary.queue,
        "depth": summary.depth,
        "counts": counts,
        "newest": newest,
    }))
    .into_response())
}

/// `op`'s result, if it comes while the request may still be answered (a
/// second before the server's request timeout). A dead-letter operation
/// runs to its end on a task of its own either way.
async fn in_time<T>(state: &AdminState, op: impl Future<Output = T>) -> Option<T> {
    let timeout = Duration::from_millis(state.config.http_request_timeout_ms);
    let answer_by = timeout
        .saturating_sub(Duration::from_secs(1))
        .max(timeout / 2);
    tokio::time::timeout(answer_by, op).await.ok()
}

/// A dead-letter replay or purge still running when the request must be
/// answered: 202, and where to see what it did.
fn still_running(state: &AdminState, what: &str) -> ApiResult {
    let queue = state.config.topology().map_err(bad_request)?.dead_queue();
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({
            "queue": queue,
            "running": what,
            "detail": format!(
                "the {what} goes on to its end; its entry in the audit history \
                 (GET /v1/history, target dlq) will say what it did"
            ),
        })),
    )
        .into_response())
}

fn unavailable(e: anyhow::Error) -> ApiError {
    ApiError(StatusCode::SERVICE_UNAVAILABLE, format!("{e:#}"))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplayBody {
    reason: Option<String>,
    tenant: Option<String>,
    limit: Option<usize>,
}

/// `tollgate dlq replay`: attempts start over, idempotency keys are kept.
async fn dlq_replay(
    State(state): State<AdminState>,
    By(actor): By,
    Body(body): Body<ReplayBody>,
) -> ApiResult {
    let reason = body
        .reason
        .as_deref()
        .map(crate::cli::dead_reason)
        .transpose()
        .map_err(|e| bad_request(format!("reason {e:#}")))?;
    if let Some(t) = &body.tenant {
        TenantId::parse(t).map_err(bad_request)?;
    }
    let replay = crate::cli::dlq_replay(
        &state.config,
        reason,
        body.tenant.as_deref(),
        body.limit.unwrap_or(usize::MAX),
        &actor,
    );
    let Some(done) = in_time(&state, replay).await else {
        return still_running(&state, "replay");
    };
    let done = done.map_err(unavailable)?;
    Ok(Json(json!({
        "queue": done.queue,
        "replayed": done.replayed,
        "left": done.left,
        "unaudited": done.unaudited,
    }))
    .into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PurgeBody {
    /// The dead-letter queue's name, as the operator typed it to confirm.
    confirm: String,
}

/// `tollgate dlq purge`: only when `confirm` names the queue.
async fn dlq_purge(
    State(state): State<AdminState>,
    By(actor): By,
    Body(body): Body<PurgeBody>,
) -> ApiResult {
    let queue = state.config.topology().map_err(bad_request)?.dead_queue();
    if body.confirm != queue {
        return Err(bad_request(format!(
            "not confirmed: \"confirm\" must be the queue's name, {queue:?}; nothing deleted"
        )));
    }
    let purge = crate::cli::dlq_purge(&state.config, |_, _| Ok(true), &actor);
    let Some(done) = in_time(&state, purge).await else {
        return still_running(&state, "purge");
    };
    let done = done.map_err(unavailable)?;
    Ok(Json(json!({"purged": done.purged, "unaudited": done.unaudited})).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("BEARER  abc"), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer"), None);
    }

    #[test]
    fn short_tokens_cannot_be_built() {
        assert!(AdminToken::new(Secret::new("")).is_err());
        assert!(AdminToken::new(Secret::new("fifteen-bytes!!")).is_err());
        assert!(AdminToken::new(Secret::new("sixteen-bytes!!!")).is_ok());
    }

    #[test]
    fn token_comparison_is_exact() {
        assert!(constant_time_eq(b"s3cret", b"s3cret"));
        assert!(!constant_time_eq(b"s3cret", b"s3creT"));
        assert!(!constant_time_eq(b"s3cret", b"s3cret!"));
        assert!(!constant_time_eq(b"", b"s3cret"));
    }
}
