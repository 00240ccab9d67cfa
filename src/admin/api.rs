//! The REST API: JSON over HTTP, served by `strata serve` next to `/metrics`.
//! Every other `strata` subcommand is a client of it (see `admin::cli`).
//!
//! Errors are always `{"error": "<one line>"}` with a status that says what
//! kind of failure it was: 400 invalid request (bad JSON, bad value, unknown
//! property), 404 no such pool/volume/dataset/endpoint, 409 name taken or volume busy,
//! 500 internal. The endpoint list is in docs/CLI.md and at `GET /v1`.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, Path, Query, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use super::auth::{authenticate, ApiAuth};
use crate::analytics::query as analytics;
use crate::control::catalog::DeviceRecord;
use crate::control::manager::{
    role_for_add, validate_component, AdminError, DatasetInfo, DatasetSnapshotInfo, PoolStatus, SnapshotView,
    VolumeInfo, VolumeManager,
};
use crate::pool::migrate::{MigrationStatus, PassSummary};
use crate::units::parse_size;

/// Content type of the Prometheus text exposition format.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// Every endpoint, as listed by `GET /` and `GET /v1`.
pub const ENDPOINTS: [&str; 53] = [
    "GET /metrics",
    "GET /v1/pools",
    "POST /v1/pools",
    "GET /v1/pools/{pool}",
    "POST /v1/pools/{pool}/devices",
    "POST /v1/pools/{pool}/attach",
    "POST /v1/pools/{pool}/detach",
    "POST /v1/pools/{pool}/replace",
    "POST /v1/pools/{pool}/remove",
    "GET /v1/pools/{pool}/scrub",
    "POST /v1/pools/{pool}/scrub",
    "GET /v1/volumes[?pool=POOL]",
    "POST /v1/volumes",
    "GET /v1/volumes/{pool}/{name}",
    "PATCH /v1/volumes/{pool}/{name}",
    "POST /v1/volumes/{pool}/{name}/resize",
    "DELETE /v1/volumes/{pool}/{name}",
    "POST /v1/volumes/{pool}/{name}/promote",
    "GET /v1/filesystems",
    "POST /v1/filesystems",
    "GET /v1/filesystems/{pool}/{name}",
    "PATCH /v1/filesystems/{pool}/{name}",
    "DELETE /v1/filesystems/{pool}/{name}",
    "POST /v1/filesystems/{pool}/{name}/promote",
    "GET /v1/filesystems/{pool}/{name}/snapshots",
    "POST /v1/filesystems/{pool}/{name}/snapshots",
    "DELETE /v1/filesystems/{pool}/{name}/snapshots/{snapshot}",
    "POST /v1/filesystems/{pool}/{name}/snapshots/{snapshot}/rollback",
    "POST /v1/filesystems/{pool}/{name}/snapshots/{snapshot}/clone",
    "GET /v1/filesystem-snapshots",
    "POST /v1/pools/{pool}/sync",
    "GET /v1/pools/{pool}/properties",
    "PATCH /v1/pools/{pool}/properties",
    "POST /v1/pools/{pool}/migrate[?wait=false]",
    "GET /v1/snapshots[?volume=POOL/NAME]",
    "POST /v1/snapshots",
    "DELETE /v1/snapshots/{pool}/{name}@{snapshot}",
    "POST /v1/snapshots/{pool}/{name}@{snapshot}/rollback",
    "POST /v1/snapshots/{pool}/{name}@{snapshot}/clone",
    "GET /v1/snapshots/{pool}/{name}@{snapshot}/send[?from=SNAP][&resume=TOKEN]",
    "POST /v1/volumes/{pool}/{name}/receive[?resume=true]",
    "GET /v1/volumes/{pool}/{name}/receive",
    "DELETE /v1/volumes/{pool}/{name}/receive",
    "GET /v1/iscsi",
    "PATCH /v1/iscsi",
    "GET /ui",
    "GET /openapi.json",
    "GET /v1/analytics",
    "GET /v1/analytics/stats[?from=&to=&volume=&protocol=&op=&client=&by=&min_ns=&max_ns=&top=]",
    "GET /v1/analytics/heatmap[?same parameters]",
    "GET /v1/analytics/rates[?same parameters]",
    "GET /v1/analytics/offsets?volume=POOL/NAME[&from=&to=]",
    "GET /v1",
];

type Manager = Arc<VolumeManager>;

/// An error answer: a status and a one-line message.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: one_line(&message.into()),
        }
    }

    pub(super) fn status(&self) -> StatusCode {
        self.status
    }

    fn invalid(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
}

/// Messages go on one line so the CLI can print them as they are.
pub(super) fn one_line(text: &str) -> String {
    text.trim().lines().map(str::trim).collect::<Vec<_>>().join("; ")
}

impl From<AdminError> for ApiError {
    fn from(error: AdminError) -> Self {
        let status = match &error {
            AdminError::NotFound(_) => StatusCode::NOT_FOUND,
            AdminError::AlreadyExists(_) | AdminError::Busy(_) => StatusCode::CONFLICT,
            AdminError::Invalid(_) => StatusCode::BAD_REQUEST,
            AdminError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            AdminError::NoSpace(_) => StatusCode::INSUFFICIENT_STORAGE,
            AdminError::Io(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        ApiError::new(status, error.to_string())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        let status = match &rejection {
            // Not malformed, just not labelled: keep the honest status (it also
            // keeps plain HTML forms from other origins out).
            JsonRejection::MissingJsonContentType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            JsonRejection::BytesRejection(_) => rejection.status(),
            _ => StatusCode::BAD_REQUEST,
        };
        let message = match &rejection {
            JsonRejection::MissingJsonContentType(_) => {
                "expected a JSON body with 'Content-Type: application/json'".to_string()
            }
            _ => format!("invalid JSON body: {}", rejection.body_text()),
        };
        ApiError::new(status, message)
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        ApiError::new(rejection.status(), format!("invalid path: {}", rejection.body_text()))
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError::new(rejection.status(), format!("invalid query: {}", rejection.body_text()))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// Runs a manager call on the blocking pool: admin operations take a std
/// mutex and fsync files, which must not stall the runtime's workers.
async fn blocking<T, F>(manager: &Manager, call: F) -> ApiResult<T>
where
    T: Send + 'static,
    F: FnOnce(&VolumeManager) -> Result<T, AdminError> + Send + 'static,
{
    let manager = manager.clone();
    tokio::task::spawn_blocking(move || call(&manager))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("internal error: {e}")))?
        .map_err(ApiError::from)
}

/// A size given as a byte count (`10737418240`) or a string (`"10G"`).
fn size_from_json(value: &Value) -> ApiResult<u64> {
    match value {
        Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| ApiError::invalid(format!("invalid size {n}: expected a whole number of bytes"))),
        Value::String(s) => parse_size(s).map_err(ApiError::invalid),
        other => Err(ApiError::invalid(format!(
            "invalid size {other}: expected a byte count or a string such as \"10G\""
        ))),
    }
}

/// `{"sync": "always", "volblocksize": 65536, "wce": false}` as `(key, value)`
/// pairs in the spelling the manager validates.
fn properties_from_json(properties: &BTreeMap<String, Value>) -> ApiResult<Vec<(String, String)>> {
    properties
        .iter()
        .map(|(key, value)| {
            let text = match value {
                Value::String(s) => s.clone(),
                // 702.0 is the integer 702 (as JSON Schema counts it).
                Value::Number(n) => match n.as_f64() {
                    Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15 => format!("{}", f as i64),
                    _ => n.to_string(),
                },
                Value::Bool(true) => "on".to_string(),
                Value::Bool(false) => "off".to_string(),
                other => {
                    return Err(ApiError::invalid(format!(
                        "bad value {other} for property '{key}': expected a string"
                    )))
                }
            };
            Ok((key.clone(), text))
        })
        .collect()
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct CreateRequest {
    name: String,
    size: Option<Value>,
    #[serde(default)]
    properties: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct SetRequest {
    #[serde(default)]
    properties: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ResizeRequest {
    size: Value,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct ListQuery {
    pool: Option<String>,
}

/// Splits a dataset's `pool/name` and validates both parts (as
/// `split_volume_name` does volumes', with a dataset's wording).
pub(super) fn split_dataset_name(text: &str) -> Result<(&str, &str), AdminError> {
    let (pool, name) = text
        .split_once('/')
        .ok_or_else(|| AdminError::Invalid(format!("invalid dataset name '{text}': expected POOL/NAME")))?;
    validate_component("pool", pool)?;
    validate_component("dataset", name)?;
    Ok((pool, name))
}

/// A new dataset snapshot's own name: the rule of volume snapshots' (a
/// name of at most 64 bytes), which `/openapi.json` states.
fn validate_snapshot_part(snapshot: &str) -> Result<(), AdminError> {
    validate_component("snapshot", snapshot)?;
    if snapshot.len() > crate::meta::log::MAX_SNAPSHOT_NAME {
        return Err(AdminError::Invalid(format!(
            "invalid snapshot name '{snapshot}': at most {} bytes",
            crate::meta::log::MAX_SNAPSHOT_NAME
        )));
    }
    Ok(())
}

/// A JSON body that may be left out (an empty body means the defaults);
/// one that is given is taken as `Json` takes it, with its statuses.
async fn optional_json<T: serde::de::DeserializeOwned + Default>(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<T> {
    let bytes = body
        .map_err(|rejection| ApiError::new(rejection.status(), format!("invalid body: {}", rejection.body_text())))?;
    if bytes.is_empty() {
        return Ok(T::default());
    }
    let mut request = axum::http::Request::new(axum::body::Body::from(bytes));
    if let Some(content_type) = headers.get(header::CONTENT_TYPE) {
        request.headers_mut().insert(header::CONTENT_TYPE, content_type.clone());
    }
    let Json(value) = Json::<T>::from_request(request, &()).await?;
    Ok(value)
}

/// `pool/name` of a route's path, which names something that exists (a
/// pool's volume or dataset; `name` may be `volume@snapshot`). A name that
/// no pool, volume or snapshot can have names nothing: 404, as a valid name
/// that is not there.
pub(super) fn full_name(pool: &str, name: &str) -> ApiResult<String> {
    let valid = |text: &str| validate_component("", text).is_ok();
    let name_valid = match name.split_once('@') {
        Some((volume, snapshot)) => valid(volume) && validate_snapshot_part(snapshot).is_ok(),
        None => valid(name),
    };
    if valid(pool) && name_valid {
        Ok(format!("{pool}/{name}"))
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("'{}/{}' does not exist", one_line(pool), one_line(name)),
        ))
    }
}

#[utoipa::path(get, path = "/v1", tag = "meta", responses((status = 200, description = "Name, version and the endpoint list", body = Object)))]
async fn index() -> Json<Value> {
    Json(json!({
        "name": "strata",
        "version": env!("CARGO_PKG_VERSION"),
        "endpoints": ENDPOINTS.to_vec(),
    }))
}

#[utoipa::path(get, path = "/metrics", tag = "meta", security((), ("bearer" = [])), responses((status = 200, description = "Prometheus text exposition (text/plain; version=0.0.4)", body = String, content_type = "text/plain")))]
async fn metrics(State(manager): State<Manager>) -> Response {
    let pools = blocking(&manager, |m| Ok(m.pool_status())).await.unwrap_or_default();
    let body = super::metrics::render(&manager.volumes())
        + &super::metrics::render_backing(&pools)
        + &super::metrics::render_nfs(crate::frontend::nfs::drc::daemon_stats())
        + &super::metrics::render_fs(crate::fs::deferred_frees());
    ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], body).into_response()
}

#[utoipa::path(get, path = "/v1/pools", tag = "pools", responses((status = 200, description = "Every pool", body = Vec<PoolStatus>), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn list_pools(State(manager): State<Manager>) -> ApiResult<Json<Vec<PoolStatus>>> {
    blocking(&manager, |m| Ok(m.pool_status())).await.map(Json)
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct CreatePoolRequest {
    name: String,
    devices: Vec<DeviceRecord>,
    #[serde(default)]
    chunk_bytes: Option<u32>,
    /// RAM for caching: half the write-back bound, half the read cache.
    #[serde(default)]
    ram_bytes: Option<u64>,
    /// Write over devices that hold data or a known signature.
    #[serde(default)]
    force: bool,
}

#[utoipa::path(post, path = "/v1/pools", tag = "pools", request_body = CreatePoolRequest, responses((status = 201, description = "The new pool", body = PoolStatus), (status = 409, description = "Name taken or busy", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn create_pool(
    State(manager): State<Manager>,
    body: Result<Json<CreatePoolRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<PoolStatus>)> {
    let Json(request) = body?;
    for device in &request.devices {
        device_exists(&device.path)?;
    }
    let status = blocking(&manager, move |m| {
        m.create_pool(
            &request.name,
            &request.devices,
            request.chunk_bytes,
            request.ram_bytes,
            request.force,
        )
    })
    .await?;
    Ok((StatusCode::CREATED, Json(status)))
}

/// 404 for a device path that names nothing (as for a pool or volume
/// that does not exist); a file that is there but cannot be used is the
/// manager's 400.
fn device_exists(path: &str) -> ApiResult<()> {
    if path.is_empty() {
        return Err(ApiError::invalid("missing device path"));
    }
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound || path.contains('\0') => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("cannot open device {path}: No such file or directory"),
        )),
        _ => Ok(()),
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct AddDeviceRequest {
    path: String,
    role: String,
    /// Further devices, each a mirror copy of `path`: the new member is a
    /// mirror of all of them.
    #[serde(default)]
    copies: Vec<String>,
    /// Write over a device that holds data or a known signature.
    #[serde(default)]
    force: bool,
}

#[utoipa::path(post, path = "/v1/pools/{pool}/devices", tag = "pools", params(("pool" = String, Path, description = "Pool name")), request_body = AddDeviceRequest, responses((status = 201, description = "The pool with its new device", body = PoolStatus), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 409, description = "Name taken or busy", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn add_device(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Json<AddDeviceRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<PoolStatus>)> {
    let Path(pool) = path?;
    let Json(request) = body?;
    let role = role_for_add(&request.role)?;
    device_exists(&request.path)?;
    for copy in &request.copies {
        device_exists(copy)?;
    }
    let device = DeviceRecord {
        path: request.path,
        role,
        mirror: None,
        write_mostly: false,
    };
    let status = blocking(&manager, move |m| {
        if request.copies.is_empty() {
            m.add_device(&pool, &device, request.force)
        } else {
            m.add_mirror(&pool, &device, &request.copies, request.force)
        }
    })
    .await?;
    Ok((StatusCode::CREATED, Json(status)))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct AttachRequest {
    /// A device of the pool: its path, or its uuid (as `pool status` names
    /// a missing device: `device UUID`).
    device: String,
    /// The device to attach: its path.
    new: String,
    /// Write over a device that holds data or a known signature.
    #[serde(default)]
    force: bool,
}

#[utoipa::path(post, path = "/v1/pools/{pool}/attach", tag = "pools", params(("pool" = String, Path, description = "Pool name")), request_body = AttachRequest, responses((status = 200, description = "The pool, the new device resilvering beside `device` (a single device becomes a mirror)", body = PoolStatus), (status = 404, description = "No such pool, or `device` is not one of its devices, or `new` does not exist", body = ErrorBody), (status = 409, description = "`new` is in use, or busy", body = ErrorBody), (status = 400, description = "Invalid request (`new` too small for the member, not empty without `force`, ...)", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn attach_device(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Json<AttachRequest>, JsonRejection>,
) -> ApiResult<Json<PoolStatus>> {
    let Path(pool) = path?;
    let Json(request) = body?;
    device_exists(&request.new)?;
    let status = blocking(&manager, move |m| {
        m.attach_device(&pool, &request.device, &request.new, false, request.force)
    })
    .await?;
    Ok(Json(status))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ReplaceRequest {
    /// The device to replace: its path, or its uuid (`device UUID`, as
    /// `pool status` names a missing one).
    old: String,
    /// The device taking its place: its path.
    new: String,
    /// Write over a device that holds data or a known signature.
    #[serde(default)]
    force: bool,
}

#[utoipa::path(post, path = "/v1/pools/{pool}/replace", tag = "pools", params(("pool" = String, Path, description = "Pool name")), request_body = ReplaceRequest, responses((status = 200, description = "The pool, `new` resilvering as `old`'s replacement; `old` is detached once it is done", body = PoolStatus), (status = 404, description = "No such pool, or `old` is not one of its devices, or `new` does not exist", body = ErrorBody), (status = 409, description = "`new` is in use, or a replacement is already under way in the mirror", body = ErrorBody), (status = 400, description = "Invalid request (`new` too small, not empty without `force`, ...)", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn replace_device(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Json<ReplaceRequest>, JsonRejection>,
) -> ApiResult<Json<PoolStatus>> {
    let Path(pool) = path?;
    let Json(request) = body?;
    device_exists(&request.new)?;
    let status = blocking(&manager, move |m| {
        m.attach_device(&pool, &request.old, &request.new, true, request.force)
    })
    .await?;
    Ok(Json(status))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct DetachRequest {
    /// The device to detach from its mirror: its path, or its uuid
    /// (`device UUID`).
    device: String,
}

#[utoipa::path(post, path = "/v1/pools/{pool}/detach", tag = "pools", params(("pool" = String, Path, description = "Pool name")), request_body = DetachRequest, responses((status = 200, description = "The pool without the device", body = PoolStatus), (status = 404, description = "No such pool, or `device` is not one of its devices", body = ErrorBody), (status = 400, description = "Refused: the device is a single-device member, or the last up-to-date copy of its mirror", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn detach_device(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Json<DetachRequest>, JsonRejection>,
) -> ApiResult<Json<PoolStatus>> {
    let Path(pool) = path?;
    let Json(request) = body?;
    let status = blocking(&manager, move |m| m.detach_device(&pool, &request.device)).await?;
    Ok(Json(status))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct RemoveDeviceRequest {
    /// The device to remove: its path, or for a whole mirror `mirror-N`
    /// or the path of any of its devices.
    device: String,
}

#[utoipa::path(post, path = "/v1/pools/{pool}/remove", tag = "pools", params(("pool" = String, Path, description = "Pool name")), request_body = RemoveDeviceRequest, responses((status = 202, description = "The removal is under way (the device takes no new data; its progress is the device's `removal` in the pool's status)", body = PoolStatus), (status = 404, description = "No such pool, or the device is not one of its members", body = ErrorBody), (status = 400, description = "Invalid request, or the device cannot be removed (the reason)", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn remove_device(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Json<RemoveDeviceRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<PoolStatus>)> {
    let Path(pool) = path?;
    let Json(request) = body?;
    // `remove_device` keeps the manager (`Arc`) for the move it starts.
    let status = tokio::task::spawn_blocking(move || manager.remove_device(&pool, &request.device))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("internal error: {e}")))?
        .map_err(ApiError::from)?;
    Ok((StatusCode::ACCEPTED, Json(status)))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ScrubRequest {
    /// `start` (the default: a new scrub, or the paused one from where it
    /// stopped), `pause` or `stop`.
    #[serde(default = "scrub_start")]
    action: crate::control::manager::ScrubAction,
}

fn scrub_start() -> crate::control::manager::ScrubAction {
    crate::control::manager::ScrubAction::Start
}

#[utoipa::path(get, path = "/v1/pools/{pool}/scrub", tag = "pools", params(("pool" = String, Path, description = "Pool name")), responses((status = 200, description = "The scrub under way or the last one (`null`: never scrubbed)", body = Option<crate::pool::ScrubStatus>), (status = 404, description = "No such pool", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn get_scrub(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<Option<crate::pool::ScrubStatus>>> {
    let Path(pool) = path?;
    let status = manager
        .pool_status()
        .into_iter()
        .find(|p| p.name == pool)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("pool '{pool}' does not exist")))?;
    Ok(Json(status.scrub))
}

#[utoipa::path(post, path = "/v1/pools/{pool}/scrub", tag = "pools", params(("pool" = String, Path, description = "Pool name")), request_body = ScrubRequest, responses((status = 202, description = "Started or resumed (it runs in the background), or paused or stopped: the scrub's status", body = crate::pool::ScrubStatus), (status = 404, description = "No such pool", body = ErrorBody), (status = 400, description = "Invalid request: a scrub already runs, or none to pause or stop", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn scrub_pool(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Json<ScrubRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<crate::pool::ScrubStatus>)> {
    let Path(pool) = path?;
    let Json(request) = body?;
    // Pausing waits for the run being read; the scrub keeps the manager.
    let status = tokio::task::spawn_blocking(move || manager.scrub_pool(&pool, request.action))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("internal error: {e}")))?
        .map_err(ApiError::from)?;
    Ok((StatusCode::ACCEPTED, Json(status)))
}

#[utoipa::path(post, path = "/v1/pools/{pool}/sync", tag = "pools", params(("pool" = String, Path, description = "Pool name")), responses((status = 200, description = "Everything cached is placed and checkpointed", body = PoolStatus), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn sync_pool(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<PoolStatus>> {
    let Path(pool) = path?;
    Ok(Json(manager.sync_pool(&pool).await?))
}

/// A pool property change: `{"migration.high": "80", "migration": "off"}`
/// (numbers and booleans are taken too; `{"properties": {...}}`, the form
/// `PATCH /v1/volumes/...` takes, as well).
/// Values are strings; a value that clears a property (`migration.window`:
/// `none` or empty) sets it back to its default.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct PoolSetRequest {
    /// `on` or `off`.
    migration: Option<String>,
    /// Percent of the fast tier in use above which cold chunks move down.
    #[schema(rename = "migration.high")]
    migration_high: Option<String>,
    /// Percent where demotion stops (below `migration.high`).
    #[schema(rename = "migration.low")]
    migration_low: Option<String>,
    /// `HH:MM-HH:MM` (UTC) or `none`.
    #[schema(rename = "migration.window")]
    migration_window: Option<String>,
}

#[utoipa::path(get, path = "/v1/pools/{pool}/properties", tag = "pools", params(("pool" = String, Path, description = "Pool name")), responses((status = 200, description = "Every pool property with its value and source (default or local)", body = PropertyList), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn get_pool_properties(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<Value>> {
    let Path(pool) = path?;
    let rows = blocking(&manager, move |m| m.pool_properties(&pool)).await?;
    Ok(Json(json!({ "properties": rows })))
}

#[utoipa::path(patch, path = "/v1/pools/{pool}/properties", tag = "pools", params(("pool" = String, Path, description = "Pool name")), request_body = PoolSetRequest, responses((status = 200, description = "The pool's properties after the change (all checked before any is applied)", body = PropertyList), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 400, description = "A value refused, or values that do not go together: migration.low not below migration.high, a migration.window whose two times are equal", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn set_pool_properties(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
    body: Result<Json<BTreeMap<String, Value>>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let Path(pool) = path?;
    let Json(mut request) = body?;
    if let (1, Some(Value::Object(inner))) = (request.len(), request.get("properties")) {
        request = inner.clone().into_iter().collect();
    }
    let changes = properties_from_json(&request)?;
    let rows = blocking(&manager, move |m| m.set_pool_properties(&pool, &changes)).await?;
    Ok(Json(json!({ "properties": rows })))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct MigrateQuery {
    /// `false`: start the pass and answer at once (202, the migrator's
    /// status); default `true`: answer with the pass's summary when it ends.
    wait: Option<bool>,
}

#[utoipa::path(post, path = "/v1/pools/{pool}/migrate", tag = "pools", params(("pool" = String, Path, description = "Pool name"), MigrateQuery), responses((status = 200, description = "The pass ran (wait=true, the default): what it moved", body = PassSummary), (status = 202, description = "The pass is started (wait=false): the migrator's status", body = MigrationStatus), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn migrate_pool(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
    query: Result<Query<MigrateQuery>, QueryRejection>,
) -> ApiResult<Response> {
    let Path(pool) = path?;
    let Query(query) = query?;
    if query.wait == Some(false) {
        let status = blocking(&manager, move |m| m.start_migration(&pool)).await?;
        return Ok((StatusCode::ACCEPTED, Json(status)).into_response());
    }
    let summary = manager.migrate_pool(&pool).await?;
    Ok(Json(summary).into_response())
}

#[utoipa::path(get, path = "/v1/pools/{pool}", tag = "pools", params(("pool" = String, Path, description = "Pool name")), responses((status = 200, description = "The pool", body = PoolStatus), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn get_pool(
    State(manager): State<Manager>,
    path: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<PoolStatus>> {
    let Path(pool) = path?;
    blocking(&manager, move |m| {
        m.pool_status()
            .into_iter()
            .find(|p| p.name == pool)
            .ok_or_else(|| AdminError::NotFound(format!("pool '{pool}' does not exist")))
    })
    .await
    .map(Json)
}

#[utoipa::path(get, path = "/v1/volumes", tag = "volumes", params(ListQuery), responses((status = 200, description = "Volumes", body = Vec<VolumeInfo>), (status = 404, description = "No such pool", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn list_volumes(
    State(manager): State<Manager>,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> ApiResult<Json<Vec<VolumeInfo>>> {
    let Query(query) = query?;
    blocking(&manager, move |m| {
        let Some(pool) = query.pool else {
            return Ok(m.list());
        };
        if !m.pool_status().iter().any(|p| p.name == pool) {
            return Err(AdminError::NotFound(format!("pool '{pool}' does not exist")));
        }
        Ok(m.list().into_iter().filter(|v| v.pool == pool).collect())
    })
    .await
    .map(Json)
}

#[utoipa::path(post, path = "/v1/volumes", tag = "volumes", request_body = CreateRequest, responses((status = 201, description = "The new volume", body = VolumeInfo), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 409, description = "Name taken or busy", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn create_volume(
    State(manager): State<Manager>,
    body: Result<Json<CreateRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<VolumeInfo>)> {
    let Json(request) = body?;
    let properties = properties_from_json(&request.properties)?;
    let size = match &request.size {
        Some(size) => size_from_json(size)?,
        // `properties.volsize` alone is enough; the manager applies it.
        None if request.properties.contains_key("volsize") => 0,
        None => return Err(ApiError::invalid("missing 'size': give the volume size, e.g. \"10G\"")),
    };
    let name = request.name;
    let info = blocking(&manager, move |m| m.create(&name, size, &properties)).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

#[utoipa::path(get, path = "/v1/volumes/{pool}/{name}", tag = "volumes", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Volume name")), responses((status = 200, description = "The volume", body = VolumeInfo), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn get_volume(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<VolumeInfo>> {
    let Path((pool, name)) = path?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| m.info(&full)).await.map(Json)
}

#[utoipa::path(patch, path = "/v1/volumes/{pool}/{name}", tag = "volumes", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Volume name")), request_body = SetRequest, responses((status = 200, description = "The volume with its new properties", body = VolumeInfo), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn set_volume(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Result<Json<SetRequest>, JsonRejection>,
) -> ApiResult<Json<VolumeInfo>> {
    let Path((pool, name)) = path?;
    let Json(request) = body?;
    let properties = properties_from_json(&request.properties)?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| m.set(&full, &properties)).await.map(Json)
}

#[utoipa::path(post, path = "/v1/volumes/{pool}/{name}/resize", tag = "volumes", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Volume name")), request_body = ResizeRequest, responses((status = 200, description = "The resized volume", body = VolumeInfo), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn resize_volume(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Result<Json<ResizeRequest>, JsonRejection>,
) -> ApiResult<Json<VolumeInfo>> {
    let Path((pool, name)) = path?;
    let Json(request) = body?;
    let size = size_from_json(&request.size)?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| m.resize(&full, size)).await.map(Json)
}

#[utoipa::path(delete, path = "/v1/volumes/{pool}/{name}", tag = "volumes", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Volume name")), responses((status = 204, description = "Deleted"), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 409, description = "Name taken or busy", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn delete_volume(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<StatusCode> {
    let Path((pool, name)) = path?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| m.delete(&full)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct CreateDatasetRequest {
    /// `pool/name` of the new dataset (volumes and datasets share names).
    name: String,
    /// `recordsize` (fixed at creation), `quota`, `nfs.clients`, `nfs.ro`,
    /// `nfs.squash`, `nfs.anonuid`, `nfs.anongid`, `nfs.insecure`,
    /// `snapshot.schedule`; the others have their defaults.
    #[serde(default)]
    properties: BTreeMap<String, Value>,
}

#[utoipa::path(get, path = "/v1/filesystems", tag = "filesystems", responses((status = 200, description = "File datasets", body = Vec<DatasetInfo>), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn list_filesystems(State(manager): State<Manager>) -> ApiResult<Json<Vec<DatasetInfo>>> {
    blocking(&manager, |m| Ok(m.fs_list())).await.map(Json)
}

#[utoipa::path(post, path = "/v1/filesystems", tag = "filesystems", request_body = CreateDatasetRequest, responses((status = 201, description = "The new dataset, exported over NFS at once", body = DatasetInfo), (status = 404, description = "No such pool", body = ErrorBody), (status = 409, description = "Name taken (by a dataset or a volume)", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn create_filesystem(
    State(manager): State<Manager>,
    body: Result<Json<CreateDatasetRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<DatasetInfo>)> {
    let Json(request) = body?;
    split_dataset_name(&request.name)?;
    let properties = properties_from_json(&request.properties)?;
    let name = request.name;
    let info = blocking(&manager, move |m| m.fs_create(&name, &properties)).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

#[utoipa::path(get, path = "/v1/filesystems/{pool}/{name}", tag = "filesystems", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Dataset name")), responses((status = 200, description = "The dataset", body = DatasetInfo), (status = 404, description = "No such dataset", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn get_filesystem(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<DatasetInfo>> {
    let Path((pool, name)) = path?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| m.fs_info(&full)).await.map(Json)
}

#[utoipa::path(patch, path = "/v1/filesystems/{pool}/{name}", tag = "filesystems", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Dataset name")), request_body = SetRequest, responses((status = 200, description = "The dataset with its new properties (all checked before any is applied; recordsize cannot change)", body = DatasetInfo), (status = 404, description = "No such dataset", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn set_filesystem(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Result<Json<SetRequest>, JsonRejection>,
) -> ApiResult<Json<DatasetInfo>> {
    let Path((pool, name)) = path?;
    let Json(request) = body?;
    let properties = properties_from_json(&request.properties)?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| m.fs_set(&full, &properties))
        .await
        .map(Json)
}

#[utoipa::path(delete, path = "/v1/filesystems/{pool}/{name}", tag = "filesystems", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Dataset name")), responses((status = 204, description = "Destroyed with its files (NFS clients still using it get NFS3ERR_STALE)"), (status = 404, description = "No such dataset", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn destroy_filesystem(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<StatusCode> {
    let Path((pool, name)) = path?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| m.fs_destroy(&full)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/filesystems/{pool}/{name}/promote", tag = "filesystems", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Dataset name (a clone)")), responses((status = 200, description = "The promoted clone: its origin snapshot and the older ones of the origin's dataset are its own now, and that dataset is a clone of the snapshot", body = DatasetInfo), (status = 404, description = "No such dataset", body = ErrorBody), (status = 409, description = "A snapshot that would move is being destroyed", body = ErrorBody), (status = 400, description = "Not a clone, or a snapshot name of the clone clashes with one that would move", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn promote_filesystem(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<DatasetInfo>> {
    let Path((pool, name)) = path?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| m.fs_promote(&full)).await.map(Json)
}

#[utoipa::path(get, path = "/v1/filesystems/{pool}/{name}/snapshots", tag = "filesystems", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Dataset name")), responses((status = 200, description = "The dataset's snapshots, oldest first", body = Vec<DatasetSnapshotInfo>), (status = 404, description = "No such dataset", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn list_filesystem_snapshots(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<Vec<DatasetSnapshotInfo>>> {
    let Path((pool, name)) = path?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| m.fs_snapshots(Some(&full))).await.map(Json)
}

#[utoipa::path(get, path = "/v1/filesystem-snapshots", tag = "filesystems", responses((status = 200, description = "Every dataset's snapshots", body = Vec<DatasetSnapshotInfo>), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn list_all_filesystem_snapshots(State(manager): State<Manager>) -> ApiResult<Json<Vec<DatasetSnapshotInfo>>> {
    blocking(&manager, |m| m.fs_snapshots(None)).await.map(Json)
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct CreateDatasetSnapshotRequest {
    /// The snapshot's name (seen by NFS clients as `.snapshot/NAME`).
    name: String,
}

#[utoipa::path(post, path = "/v1/filesystems/{pool}/{name}/snapshots", tag = "filesystems", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Dataset name")), request_body = CreateDatasetSnapshotRequest, responses((status = 201, description = "Taken: every write acknowledged before is in it", body = DatasetSnapshotInfo), (status = 404, description = "No such dataset", body = ErrorBody), (status = 409, description = "The dataset has a snapshot of that name", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn create_filesystem_snapshot(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Result<Json<CreateDatasetSnapshotRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<DatasetSnapshotInfo>)> {
    let Path((pool, name)) = path?;
    let Json(request) = body?;
    validate_snapshot_part(&request.name)?;
    let full = format!("{}@{}", full_name(&pool, &name)?, request.name);
    let info = blocking(&manager, move |m| m.fs_snapshot(&full)).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

#[utoipa::path(delete, path = "/v1/filesystems/{pool}/{name}/snapshots/{snapshot}", tag = "filesystems", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Dataset name"), ("snapshot" = String, Path, description = "Snapshot name")), responses((status = 204, description = "Destroyed (NFS clients still in it get NFS3ERR_STALE)"), (status = 404, description = "No such snapshot", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn destroy_filesystem_snapshot(
    State(manager): State<Manager>,
    path: Result<Path<(String, String, String)>, PathRejection>,
) -> ApiResult<StatusCode> {
    let Path((pool, name, snapshot)) = path?;
    let full = full_name(&pool, &format!("{name}@{snapshot}"))?;
    blocking(&manager, move |m| m.fs_snapshot_destroy(&full)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct FsRollbackRequest {
    /// Destroy the snapshots newer than this one first.
    #[serde(default)]
    destroy_newer: bool,
}

#[utoipa::path(post, path = "/v1/filesystems/{pool}/{name}/snapshots/{snapshot}/rollback", tag = "filesystems", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Dataset name"), ("snapshot" = String, Path, description = "Snapshot name")), request_body = FsRollbackRequest, responses((status = 204, description = "Rolled back"), (status = 404, description = "No such dataset or snapshot", body = ErrorBody), (status = 400, description = "Newer snapshots exist (destroy_newer not set)", body = ErrorBody), (status = 409, description = "A newer snapshot has clones", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn rollback_filesystem(
    State(manager): State<Manager>,
    path: Result<Path<(String, String, String)>, PathRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<StatusCode> {
    let Path((pool, name, snapshot)) = path?;
    let request: FsRollbackRequest = optional_json(&headers, body).await?;
    let full = full_name(&pool, &format!("{name}@{snapshot}"))?;
    blocking(&manager, move |m| m.fs_rollback(&full, request.destroy_newer)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/filesystems/{pool}/{name}/snapshots/{snapshot}/clone", tag = "filesystems", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Dataset name"), ("snapshot" = String, Path, description = "Snapshot name")), request_body = CloneRequest, responses((status = 201, description = "The new dataset", body = DatasetInfo), (status = 404, description = "No such dataset or snapshot", body = ErrorBody), (status = 409, description = "Name taken", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn clone_filesystem_snapshot(
    State(manager): State<Manager>,
    path: Result<Path<(String, String, String)>, PathRejection>,
    body: Result<Json<CloneRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<DatasetInfo>)> {
    let Path((pool, name, snapshot)) = path?;
    let Json(request) = body?;
    let properties = properties_from_json(&request.properties)?;
    let origin = full_name(&pool, &format!("{name}@{snapshot}"))?;
    let info = blocking(&manager, move |m| m.fs_clone(&origin, &request.name, &properties)).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct SnapshotRequest {
    /// `pool/volume@snapshot` names, taken at one consistency point.
    names: Vec<String>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
struct SnapshotQuery {
    /// `pool/volume`: only its snapshots.
    volume: Option<String>,
}

#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots", params(SnapshotQuery), responses((status = 200, description = "Snapshots", body = Vec<SnapshotView>), (status = 404, description = "No such volume", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn list_snapshots(
    State(manager): State<Manager>,
    query: Result<Query<SnapshotQuery>, QueryRejection>,
) -> ApiResult<Json<Vec<SnapshotView>>> {
    let Query(query) = query?;
    blocking(&manager, move |m| m.list_snapshots(query.volume.as_deref()))
        .await
        .map(Json)
}

#[utoipa::path(post, path = "/v1/snapshots", tag = "snapshots", request_body = SnapshotRequest, responses((status = 201, description = "The snapshots, taken at one consistency point", body = Vec<SnapshotView>), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 409, description = "Name taken or busy", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn create_snapshots(
    State(manager): State<Manager>,
    body: Result<Json<SnapshotRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Vec<SnapshotView>>)> {
    let Json(request) = body?;
    let taken = blocking(&manager, move |m| m.create_snapshots(&request.names)).await?;
    Ok((StatusCode::CREATED, Json(taken)))
}

#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct RollbackRequest {
    /// Delete the snapshots newer than this one first (`-r`).
    #[serde(default)]
    destroy_newer: bool,
    /// Drop the volume's clients (NBD connections, iSCSI sessions) first
    /// (`--force`).
    #[serde(default)]
    force: bool,
}

#[utoipa::path(post, path = "/v1/snapshots/{pool}/{name}/rollback", tag = "snapshots", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "VOLUME@SNAPSHOT")), request_body = RollbackRequest, responses((status = 204, description = "The volume is what it was at the snapshot"), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 409, description = "Name taken or busy", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn rollback_snapshot(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<StatusCode> {
    let Path((pool, name)) = path?;
    let request: RollbackRequest = optional_json(&headers, body).await?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| {
        m.rollback_snapshot_forced(&full, request.destroy_newer, request.force)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct CloneRequest {
    /// `pool/name` of the new volume.
    name: String,
    #[serde(default)]
    properties: BTreeMap<String, Value>,
}

#[utoipa::path(post, path = "/v1/snapshots/{pool}/{name}/clone", tag = "snapshots", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "VOLUME@SNAPSHOT")), request_body = CloneRequest, responses((status = 201, description = "The clone", body = VolumeInfo), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 409, description = "Name taken or busy", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn clone_snapshot(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Result<Json<CloneRequest>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<VolumeInfo>)> {
    let Path((pool, name)) = path?;
    let Json(request) = body?;
    let properties = properties_from_json(&request.properties)?;
    let full = full_name(&pool, &name)?;
    let info = blocking(&manager, move |m| m.clone_volume(&full, &request.name, &properties)).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

#[utoipa::path(post, path = "/v1/volumes/{pool}/{name}/promote", tag = "snapshots", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Volume name")), responses((status = 200, description = "The promoted clone", body = VolumeInfo), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 409, description = "Name taken or busy", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn promote_volume(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<Json<VolumeInfo>> {
    let Path((pool, name)) = path?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| m.promote(&full)).await.map(Json)
}

#[utoipa::path(delete, path = "/v1/snapshots/{pool}/{name}", tag = "snapshots", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "VOLUME@SNAPSHOT")), responses((status = 204, description = "Deleted (its space is freed in the background)"), (status = 404, description = "No such pool, volume or snapshot", body = ErrorBody), (status = 409, description = "Name taken or busy", body = ErrorBody), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn delete_snapshot(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> ApiResult<StatusCode> {
    let Path((pool, name)) = path?;
    let full = full_name(&pool, &name)?;
    blocking(&manager, move |m| m.delete_snapshot(&full)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The daemon-wide iSCSI settings (`discovery_auth`, ...), secrets masked.
#[utoipa::path(get, path = "/v1/iscsi", tag = "iscsi", responses((status = 200, description = "Daemon-wide iSCSI settings (secrets masked)", body = PropertyList), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn get_iscsi(State(manager): State<Manager>) -> ApiResult<Json<Value>> {
    let rows = blocking(&manager, |m| Ok(m.iscsi_settings())).await?;
    Ok(Json(json!({ "properties": rows })))
}

#[utoipa::path(patch, path = "/v1/iscsi", tag = "iscsi", request_body = SetRequest, responses((status = 200, description = "The settings after the change", body = PropertyList), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn set_iscsi(
    State(manager): State<Manager>,
    body: Result<Json<SetRequest>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let Json(request) = body?;
    // Every iSCSI setting is a string (a user name of "off" is a name).
    if let Some((key, value)) = request.properties.iter().find(|(_, value)| !value.is_string()) {
        return Err(ApiError::invalid(format!(
            "bad value {value} for iSCSI setting '{key}': expected a string"
        )));
    }
    let changes = properties_from_json(&request.properties)?;
    let rows = blocking(&manager, move |m| m.set_iscsi(&changes)).await?;
    Ok(Json(json!({ "properties": rows })))
}

async fn no_such_endpoint(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no such endpoint: {method} {}; see GET /v1", uri.path()),
    )
}

/// The dashboard: one page, its script and styles inline, nothing fetched
/// from elsewhere; it reads `/v1/analytics/*` and `/v1/pools` with the
/// token it asks for.
const DASHBOARD: &str = include_str!("ui/dashboard.html");

#[utoipa::path(get, path = "/ui", tag = "analytics", security(()), responses((status = 200, description = "The dashboard page (HTML; no token needed for the page itself)", body = String, content_type = "text/html")))]
async fn dashboard() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
            ),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        DASHBOARD,
    )
        .into_response()
}

#[utoipa::path(get, path = "/v1/analytics", tag = "analytics", responses((status = 200, description = "What is recorded and kept", body = analytics::Status), (status = 400, description = "Invalid request", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn analytics_status(State(manager): State<Manager>) -> Json<analytics::Status> {
    let analytics = manager.analytics();
    let recorders = analytics.recorders();
    let enabled = analytics.enabled();
    Json(analytics.with_history(|h| analytics::status(h, enabled, recorders)))
}

/// Runs an analytics query (400 with its message when the parameters do
/// not make sense).
fn analytics_query<T>(
    manager: &Manager,
    query: Result<Query<analytics::Params>, QueryRejection>,
    run: impl FnOnce(&crate::analytics::record::History, &analytics::Params) -> Result<T, String>,
) -> ApiResult<Json<T>> {
    let Query(mut params) = query?;
    // `?protocol=` is no filter, as a form with an empty field sends it.
    for field in [
        &mut params.volume,
        &mut params.protocol,
        &mut params.op,
        &mut params.client,
        &mut params.by,
        &mut params.phase,
    ] {
        if field.as_deref() == Some("") {
            *field = None;
        }
    }
    manager
        .analytics()
        .with_history(|h| run(h, &params))
        .map(Json)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, e))
}

#[utoipa::path(get, path = "/v1/analytics/stats", tag = "analytics", params(analytics::Params), responses((status = 200, description = "Totals, percentiles and a breakdown of a range", body = analytics::Stats), (status = 400, description = "Parameters that do not go together: from after to, more than 3601 seconds at step 1", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn analytics_stats(
    State(manager): State<Manager>,
    query: Result<Query<analytics::Params>, QueryRejection>,
) -> ApiResult<Json<analytics::Stats>> {
    analytics_query(&manager, query, analytics::stats)
}

#[utoipa::path(get, path = "/v1/analytics/heatmap", tag = "analytics", params(analytics::Params), responses((status = 200, description = "Latency heat map: requests per time row and latency bucket", body = analytics::HeatMap), (status = 400, description = "Parameters that do not go together: from after to, more than 3601 seconds at step 1", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn analytics_heatmap(
    State(manager): State<Manager>,
    query: Result<Query<analytics::Params>, QueryRejection>,
) -> ApiResult<Json<analytics::HeatMap>> {
    analytics_query(&manager, query, analytics::heatmap)
}

#[utoipa::path(get, path = "/v1/analytics/rates", tag = "analytics", params(analytics::Params), responses((status = 200, description = "Per-row totals of each breakdown entry", body = analytics::Rates), (status = 400, description = "Parameters that do not go together: from after to, more than 3601 seconds at step 1", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn analytics_rates(
    State(manager): State<Manager>,
    query: Result<Query<analytics::Params>, QueryRejection>,
) -> ApiResult<Json<analytics::Rates>> {
    analytics_query(&manager, query, analytics::rates)
}

#[utoipa::path(get, path = "/v1/analytics/offsets", tag = "analytics", params(analytics::Params), responses((status = 200, description = "Requests per region of a volume over time", body = analytics::OffsetMap), (status = 400, description = "Parameters that do not go together: from after to, more than 3601 seconds at step 1", body = ErrorBody), (status = 401, description = "No valid token (TCP)", body = ErrorBody)))]
async fn analytics_offsets(
    State(manager): State<Manager>,
    query: Result<Query<analytics::Params>, QueryRejection>,
) -> ApiResult<Json<analytics::OffsetMap>> {
    analytics_query(&manager, query, analytics::offsets)
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method {method} is not allowed on {}; see GET /v1", uri.path()),
    )
}

/// Every error answer's body.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub(super) struct ErrorBody {
    /// One line saying what went wrong.
    error: String,
}

/// `{"properties": [...]}`: the iSCSI settings, or a pool's properties.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct PropertyList {
    properties: Vec<crate::volume::props::PropertyRow>,
}

/// A pool, volume, dataset or snapshot name as `validate_component` takes
/// it: 1-200 letters, digits, '_', '-', '.', ':', starting with a letter or
/// digit.
const NAME: &str = "[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}";
/// A snapshot's own name: a name of at most 64 bytes (a pool's log keeps
/// no longer ones).
const SNAPSHOT: &str = "[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}";
/// A size: a byte count with an optional K, M, G, T or P suffix.
const SIZE: &str = "[1-9][0-9]{0,5}([KkMmGgTt]|[KkMmGgTt][Bb]|[KkMmGgTt][Ii][Bb])?";
/// A block size of a volume or dataset: a power of two from 4K to 128K.
const BLOCK_SIZES: &str = "(4096|8192|16384|32768|65536|131072|(4|8|16|32|64|128)([Kk]|[Kk][Bb]|[Kk][Ii][Bb]))";
/// Characters `char::is_control` refuses.
const NO_CONTROL: &str = "[^\\u0000-\\u001f\\u007f-\\u009f]";

fn anchored(pattern: &str) -> String {
    format!("^({pattern})$")
}

/// A string schema matching `pattern` (anchored) between the lengths.
fn text(pattern: &str, min: usize, max: usize) -> Value {
    json!({ "type": "string", "pattern": anchored(pattern), "minLength": min, "maxLength": max })
}

fn name_schema() -> Value {
    text(NAME, 1, 200)
}

fn full_name_schema() -> Value {
    text(&format!("{NAME}/{NAME}"), 3, 401)
}

fn snapshot_schema() -> Value {
    text(SNAPSHOT, 1, 64)
}

fn volume_at_snapshot_schema() -> Value {
    text(&format!("{NAME}@{SNAPSHOT}"), 3, 265)
}

fn full_snapshot_schema() -> Value {
    text(&format!("{NAME}/{NAME}@{SNAPSHOT}"), 5, 466)
}

/// A size as a byte count or a string such as "10G".
fn size_schema(description: &str) -> Value {
    json!({
        "description": description,
        "anyOf": [
            { "type": "integer", "minimum": 1, "maximum": 1u64 << 50 },
            { "type": "string", "pattern": anchored(SIZE), "minLength": 1, "maxLength": 15 },
        ]
    })
}

fn block_size_schema(description: &str) -> Value {
    json!({
        "description": description,
        "anyOf": [
            { "type": "integer", "enum": [4096, 8192, 16384, 32768, 65536, 131072] },
            { "type": "string", "pattern": anchored(BLOCK_SIZES) },
        ]
    })
}

fn choice(values: &[&str]) -> Value {
    json!({ "type": "string", "enum": values })
}

/// `on`/`off`, or a JSON boolean.
fn on_off() -> Value {
    json!({ "anyOf": [{ "type": "boolean" }, { "type": "string", "enum": ["on", "off"] }] })
}

/// A comma-separated list of `item`s (no empty one), or `*`.
fn list_or_any(item: &str, description: &str) -> Value {
    json!({
        "type": "string",
        "description": description,
        "pattern": format!("^(\\s*\\*\\s*|{item}(,{item})*)$"),
        "minLength": 1,
    })
}

/// The volume properties `create` (all) and `set` (`creation: false`:
/// all but volblocksize) take.
fn volume_properties(creation: bool) -> Value {
    let user = text(&format!("{NO_CONTROL}*"), 0, 255);
    let secret = json!({ "anyOf": [
        { "type": "string", "enum": [""] },
        text(&format!("{NO_CONTROL}{{12,255}}"), 12, 255),
    ]});
    // One identity: not empty once trimmed, no ',' or '*', no control characters.
    let free = "[^,*\\u0000-\\u001f\\u007f-\\u009f]";
    let identity = format!("{free}*[^,*\\s\\u0000-\\u001f\\u007f-\\u009f]{free}*");
    let mut properties = json!({
        "volsize": size_schema("The volume's size"),
        "sync": choice(&["standard", "always", "disabled"]),
        "logbias": choice(&["latency", "throughput"]),
        "wce": on_off(),
        "compression": { "anyOf": [{ "type": "boolean", "enum": [false] }, choice(&["off"])] },
        "iscsi.auth": choice(&["none", "chap", "mutual"]),
        "iscsi.chap_user": user.clone(),
        "iscsi.chap_secret": secret.clone(),
        "iscsi.mutual_user": user,
        "iscsi.mutual_secret": secret,
        "iscsi.initiators": list_or_any(
            "\\s*([Ii][Qq][Nn]|[Ee][Uu][Ii]|[Nn][Aa][Aa])\\.[A-Za-z0-9.:-]{0,219}\\s*",
            "`*` or iSCSI names (iqn.…, eui.…, naa.…)"
        ),
        "nbd.tls_identities": list_or_any(&identity, "`*` or TLS identities (PSK user names or certificate CNs)"),
        "snapshot.schedule": schedule_schema(),
        "tier": choice(&["auto", "fast", "capacity"]),
    });
    if creation {
        properties["volblocksize"] = block_size_schema("The block size (at creation only)");
    }
    json!({ "type": "object", "properties": properties, "additionalProperties": false })
}

/// `off`, or `PERIOD:KEEP` rules (each period once).
fn schedule_schema() -> Value {
    json!({
        "type": "string",
        "description": "`off`, or comma-separated PERIOD:KEEP rules (frequently, hourly, daily, weekly, monthly, yearly or Ns; KEEP 1 to 1000 in all; each period once)",
        "anyOf": [
            { "enum": ["off", ""] },
            { "pattern": "^(frequently|hourly|daily|weekly|monthly|yearly):([1-9][0-9]{0,1})$" },
        ]
    })
}

fn dataset_properties(creation: bool) -> Value {
    let mut properties = json!({
        "quota": { "anyOf": [choice(&["none", "0"]), size_schema("Most bytes the dataset's files may take")] },
        "nfs.clients": list_or_any("(([0-9]{1,2}|1[0-9]{2}|2[0-4][0-9]|25[0-5])\\.){3}([0-9]{1,2}|1[0-9]{2}|2[0-4][0-9]|25[0-5])(/([0-9]|[12][0-9]|3[0-2]))?", "`*` or IPv4 addresses or networks (CIDR) that may mount it"),
        "nfs.ro": on_off(),
        "nfs.insecure": on_off(),
        "nfs.squash": choice(&["root", "all", "none"]),
        "nfs.anonuid": { "anyOf": [{ "type": "integer", "minimum": 0, "maximum": u32::MAX }, text("[0-9]{1,9}", 1, 9)] },
        "nfs.anongid": { "anyOf": [{ "type": "integer", "minimum": 0, "maximum": u32::MAX }, text("[0-9]{1,9}", 1, 9)] },
        "snapshot.schedule": schedule_schema(),
    });
    if creation {
        properties["recordsize"] = block_size_schema("The files' block size (at creation only)");
    }
    json!({ "type": "object", "properties": properties, "additionalProperties": false })
}

fn iscsi_properties() -> Value {
    let user = text(&format!("{NO_CONTROL}*"), 0, 255);
    let secret = json!({ "anyOf": [
        { "type": "string", "enum": [""] },
        text(&format!("{NO_CONTROL}{{12,255}}"), 12, 255),
    ]});
    json!({ "type": "object", "additionalProperties": false, "properties": {
        "discovery_auth": choice(&["none", "chap", "mutual"]),
        "discovery_chap_user": user.clone(),
        "discovery_chap_secret": secret.clone(),
        "discovery_mutual_user": user,
        "discovery_mutual_secret": secret,
    }})
}

/// The answer every error has: `{"error": "..."}`.
fn error_response(description: &str) -> Value {
    json!({
        "description": description,
        "content": { "application/json": { "schema": { "$ref": "#/components/schemas/ErrorBody" } } }
    })
}

/// The `op` values the analytics queries take (empty: every one).
const OP_NAMES: [&str; crate::block::OPS.len() + 1] = {
    let mut names = [""; crate::block::OPS.len() + 1];
    let mut i = 0;
    while i < crate::block::OPS.len() {
        names[i + 1] = crate::block::OPS[i].as_str();
        i += 1;
    }
    names
};

/// One dimension of an analytics breakdown (`by`).
const DIM: &str = "(volume|protocol|op|client)";

/// Operations that answer without a token over TCP.
const OPEN_OPERATIONS: [&str; 3] = ["/metrics", "/openapi.json", "/ui"];

/// Completes the generated document with what the annotations cannot say
/// as exactly: the name rules of every path parameter and body field, the
/// property maps' keys and values, and the statuses every route can give
/// (401 without a token, 400/413/415 for a body that is not the JSON
/// described, 404 for names that do not exist, 500).
fn complete(doc: &mut Value) {
    let schemas = &mut doc["components"]["schemas"];
    let set = |schemas: &mut Value, schema: &str, field: &str, value: Value| {
        schemas[schema]["properties"][field] = value;
    };
    set(schemas, "CreatePoolRequest", "name", name_schema());
    schemas["CreatePoolRequest"]["properties"]["devices"]["minItems"] = json!(1);
    schemas["DeviceRecord"]["properties"]["path"]["minLength"] = json!(1);
    schemas["CreatePoolRequest"]["properties"]["ram_bytes"]["minimum"] = json!(2 * crate::pool::ram::MIN_RAM_BYTES);
    schemas["CreateRequest"]["required"] = json!(["name", "size"]);
    set(schemas, "AddDeviceRequest", "role", choice(&["fast", "capacity"]));
    schemas["AddDeviceRequest"]["properties"]["path"]["minLength"] = json!(1);
    schemas["AddDeviceRequest"]["properties"]["copies"]["items"]["minLength"] = json!(1);
    for (schema, fields) in [
        ("AttachRequest", &["device", "new"][..]),
        ("ReplaceRequest", &["old", "new"][..]),
        ("DetachRequest", &["device"][..]),
    ] {
        for field in fields {
            schemas[schema]["properties"][field]["minLength"] = json!(1);
        }
    }
    schemas["RemoveDeviceRequest"]["properties"]["device"]["minLength"] = json!(1);
    set(schemas, "CreateRequest", "name", full_name_schema());
    set(
        schemas,
        "CreateRequest",
        "size",
        size_schema("The volume's size: a byte count or a string such as \"10G\""),
    );
    set(schemas, "CreateRequest", "properties", volume_properties(true));
    set(
        schemas,
        "ResizeRequest",
        "size",
        size_schema("The new size: a byte count or a string such as \"10G\""),
    );
    set(schemas, "CreateDatasetRequest", "name", full_name_schema());
    set(schemas, "CreateDatasetRequest", "properties", dataset_properties(true));
    set(schemas, "CreateDatasetSnapshotRequest", "name", snapshot_schema());
    set(
        schemas,
        "SnapshotRequest",
        "names",
        json!({ "type": "array", "items": full_snapshot_schema(), "minItems": 1 }),
    );
    set(schemas, "CloneRequest", "name", full_name_schema());
    set(schemas, "PoolSetRequest", "migration", choice(&["on", "off"]));
    let window = text(
        "([01][0-9]|2[0-3]):[0-5][0-9]-([01][0-9]|2[0-3]):[0-5][0-9]|none|",
        0,
        11,
    );
    set(schemas, "PoolSetRequest", "migration.window", window);
    for key in ["migration.high", "migration.low"] {
        set(schemas, "PoolSetRequest", key, text("(100|[1-9]?[0-9])%?", 1, 4));
    }
    schemas["PoolSetRequest"]["additionalProperties"] = json!(false);

    let Some(paths) = doc["paths"].as_object_mut() else {
        return;
    };
    for (path, item) in paths.iter_mut() {
        let Some(operations) = item.as_object_mut() else {
            continue;
        };
        for (method, operation) in operations.iter_mut() {
            let open = OPEN_OPERATIONS.contains(&path.as_str());
            let mut has_path_params = false;
            let mut has_params = false;
            if let Some(params) = operation.get_mut("parameters").and_then(Value::as_array_mut) {
                for param in params {
                    has_params = true;
                    let schema = match (param["in"].as_str(), param["name"].as_str()) {
                        (Some("path"), Some("pool")) => Some(name_schema()),
                        (Some("path"), Some("name")) if path.starts_with("/v1/snapshots/") => {
                            Some(volume_at_snapshot_schema())
                        }
                        (Some("path"), Some("name")) => Some(name_schema()),
                        (Some("path"), Some("snapshot")) => Some(snapshot_schema()),
                        (Some("query"), Some("pool")) => Some(name_schema()),
                        (Some("query"), Some("volume")) if path == "/v1/snapshots" => Some(full_name_schema()),
                        // Empty is no filter, as a form's empty field sends it.
                        (Some("query"), Some("protocol")) => Some(choice(&["", "nbd", "iscsi"])),
                        (Some("query"), Some("op")) => Some(choice(&OP_NAMES)),
                        (Some("query"), Some("phase")) => Some(choice(&["", "total", "queued", "commit"])),
                        (Some("query"), Some("step")) => Some(json!({ "type": "integer", "enum": [1, 60] })),
                        (Some("query"), Some("by")) => Some(json!({
                            "type": "string",
                            "pattern": anchored(&format!("({DIM}(,{DIM})*)?")),
                        })),
                        (Some("query"), Some("min_ns" | "max_ns" | "top")) => {
                            Some(json!({ "type": "integer", "minimum": 0, "maximum": u64::MAX }))
                        }
                        _ => None,
                    };
                    if path == "/v1/analytics/offsets" && param["name"] == "volume" {
                        param["required"] = json!(true);
                    }
                    has_path_params |= param["in"] == "path";
                    if let Some(schema) = schema {
                        param["schema"] = schema;
                    }
                }
            }
            // Bodies shared by several operations take different properties.
            let properties = match (method.as_str(), path.as_str()) {
                ("patch", "/v1/volumes/{pool}/{name}") | ("post", "/v1/snapshots/{pool}/{name}/clone") => {
                    Some(volume_properties(false))
                }
                ("patch", "/v1/filesystems/{pool}/{name}")
                | ("post", "/v1/filesystems/{pool}/{name}/snapshots/{snapshot}/clone") => {
                    Some(dataset_properties(false))
                }
                ("patch", "/v1/iscsi") => Some(iscsi_properties()),
                _ => None,
            };
            if path.ends_with("/rollback") && operation.get("requestBody").is_some() {
                // No body at all is the defaults.
                operation["requestBody"]["required"] = json!(false);
            }
            let json_body = operation
                .get("requestBody")
                .and_then(|body| body.get("content"))
                .and_then(|content| content.get("application/json"))
                .is_some();
            if let Some(properties) = properties {
                let content = &mut operation["requestBody"]["content"]["application/json"]["schema"];
                let mut schema = json!({
                    "type": "object",
                    "additionalProperties": false,
                    "properties": { "properties": properties },
                });
                if path.ends_with("/clone") {
                    schema["properties"]["name"] = full_name_schema();
                    schema["required"] = json!(["name"]);
                }
                *content = schema;
            }
            let responses = &mut operation["responses"];
            let mut add = |status: &str, description: &str| {
                if responses.get(status).is_none() {
                    responses[status] = error_response(description);
                }
            };
            if json_body {
                add(
                    "400",
                    "Invalid request: a body that is not the JSON described, or a value refused",
                );
                add("413", "The body is larger than 2 MiB");
                add("415", "The body is not labelled 'Content-Type: application/json'");
            }
            if has_params {
                add("400", "Invalid request: a parameter that is not as described");
            }
            if has_path_params {
                add("404", "No such pool, volume, dataset or snapshot");
            }
            if path == "/v1/pools" && method == "post" {
                add("404", "A device path names no file");
            }
            if !open {
                add("401", "No valid token (TCP)");
            } else if path == "/metrics" {
                add("401", "No valid token (TCP), when the daemon runs with --metrics-auth");
            }
            if !open && path != "/v1" {
                add("500", "Internal error");
            }
        }
    }
}

/// The OpenAPI document `GET /openapi.json` serves.
pub fn document() -> Value {
    use utoipa::OpenApi;
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
    complete(&mut doc);
    doc
}

/// The OpenAPI 3 description of this API, generated from the handlers'
/// annotations (`GET /openapi.json`; CI validates it).
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "strata",
        description = "The strata daemon's REST API: pools, volumes, file datasets, snapshots, send/receive, iSCSI settings and analytics. Over TCP every request but an open GET /metrics, GET /ui and GET /openapi.json carries `Authorization: Bearer TOKEN` (the token in DATA_DIR/api.token); the Unix socket DATA_DIR/api.sock needs none. Errors are `{\"error\": \"...\"}`."
    ),
    paths(
        index, metrics, openapi, dashboard, list_pools, create_pool, get_pool, add_device, attach_device,
        detach_device, replace_device, remove_device, get_scrub, scrub_pool, sync_pool,
        get_pool_properties, set_pool_properties, migrate_pool, list_volumes,
        create_volume, get_volume, set_volume, resize_volume, delete_volume, promote_volume, list_filesystems,
        create_filesystem, get_filesystem, set_filesystem, destroy_filesystem, promote_filesystem, list_filesystem_snapshots,
        list_all_filesystem_snapshots, create_filesystem_snapshot, destroy_filesystem_snapshot,
        rollback_filesystem, clone_filesystem_snapshot, list_snapshots,
        create_snapshots, delete_snapshot, rollback_snapshot, clone_snapshot, super::send::send,
        super::send::receive, super::send::receive_status, super::send::abort_receive, get_iscsi, set_iscsi,
        analytics_status, analytics_stats, analytics_heatmap, analytics_rates, analytics_offsets
    ),
    components(schemas(ErrorBody)),
    modifiers(&BearerToken),
    security(("bearer" = []))
)]
pub struct ApiDoc;

struct BearerToken;

impl utoipa::Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
    }
}

#[utoipa::path(get, path = "/openapi.json", tag = "meta", security(()), responses((status = 200, description = "This OpenAPI 3 description", body = Object)))]
async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_string_pretty(&document()).unwrap_or_default(),
    )
        .into_response()
}

/// The API's routes, every one behind the authentication middleware.
pub fn router(manager: Arc<VolumeManager>, auth: Arc<ApiAuth>) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/v1", get(index))
        .route("/metrics", get(metrics))
        .route("/v1/pools", get(list_pools).post(create_pool))
        .route("/v1/pools/:pool", get(get_pool))
        .route("/v1/pools/:pool/devices", post(add_device))
        .route("/v1/pools/:pool/attach", post(attach_device))
        .route("/v1/pools/:pool/detach", post(detach_device))
        .route("/v1/pools/:pool/replace", post(replace_device))
        .route("/v1/pools/:pool/remove", post(remove_device))
        .route("/v1/pools/:pool/scrub", get(get_scrub).post(scrub_pool))
        .route("/v1/pools/:pool/sync", post(sync_pool))
        .route(
            "/v1/pools/:pool/properties",
            get(get_pool_properties).patch(set_pool_properties),
        )
        .route("/v1/pools/:pool/migrate", post(migrate_pool))
        .route("/v1/volumes", get(list_volumes).post(create_volume))
        .route(
            "/v1/volumes/:pool/:name",
            get(get_volume).patch(set_volume).delete(delete_volume),
        )
        .route("/v1/volumes/:pool/:name/resize", post(resize_volume))
        .route("/v1/filesystems", get(list_filesystems).post(create_filesystem))
        .route(
            "/v1/filesystems/:pool/:name",
            get(get_filesystem).patch(set_filesystem).delete(destroy_filesystem),
        )
        .route("/v1/filesystems/:pool/:name/promote", post(promote_filesystem))
        .route(
            "/v1/filesystems/:pool/:name/snapshots",
            get(list_filesystem_snapshots).post(create_filesystem_snapshot),
        )
        .route(
            "/v1/filesystems/:pool/:name/snapshots/:snapshot",
            axum::routing::delete(destroy_filesystem_snapshot),
        )
        .route(
            "/v1/filesystems/:pool/:name/snapshots/:snapshot/rollback",
            post(rollback_filesystem),
        )
        .route(
            "/v1/filesystems/:pool/:name/snapshots/:snapshot/clone",
            post(clone_filesystem_snapshot),
        )
        .route("/v1/filesystem-snapshots", get(list_all_filesystem_snapshots))
        .route("/v1/snapshots", get(list_snapshots).post(create_snapshots))
        .route("/v1/snapshots/:pool/:name", axum::routing::delete(delete_snapshot))
        .route("/v1/snapshots/:pool/:name/rollback", post(rollback_snapshot))
        .route("/v1/snapshots/:pool/:name/clone", post(clone_snapshot))
        .route("/v1/volumes/:pool/:name/promote", post(promote_volume))
        .route("/v1/snapshots/:pool/:name/send", get(super::send::send))
        .route(
            "/v1/volumes/:pool/:name/receive",
            post(super::send::receive)
                .get(super::send::receive_status)
                .delete(super::send::abort_receive),
        )
        .route("/v1/iscsi", get(get_iscsi).patch(set_iscsi))
        .route("/ui", get(dashboard))
        .route("/openapi.json", get(openapi))
        .route("/v1/analytics", get(analytics_status))
        .route("/v1/analytics/stats", get(analytics_stats))
        .route("/v1/analytics/heatmap", get(analytics_heatmap))
        .route("/v1/analytics/rates", get(analytics_rates))
        .route("/v1/analytics/offsets", get(analytics_offsets))
        .fallback(no_such_endpoint)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(manager)
        .layer(axum::middleware::from_fn_with_state(auth, authenticate))
}
