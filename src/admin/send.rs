//! Send and receive over the REST API: `GET /v1/snapshots/{pool}/{vol@snap}/send`
//! answers with the stream as a chunked body, `POST /v1/volumes/{pool}/{name}/receive`
//! takes one. Neither holds more than a few MiB of it in memory: the
//! body moves through a bounded channel between the HTTP connection and
//! the manager (`control::manager::send`).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http_body_util::BodyExt;
use hyper::body::{Bytes, Frame};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use super::api::ApiError;
use crate::control::manager::{AdminError, VolumeManager};

/// Chunks of a stream in flight between the connection and the manager.
const CHANNEL_CHUNKS: usize = 16;

/// The content type of a send stream.
pub const STREAM_CONTENT_TYPE: &str = "application/x-strata-send-stream";
/// The response header giving the length of the body that follows.
pub const STREAM_LENGTH_HEADER: &str = "x-strata-stream-bytes";

/// A body fed from a channel (the client's and the daemon's streams).
pub struct ChannelBody(pub mpsc::Receiver<Result<Bytes, String>>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.0.poll_recv(cx) {
            Poll::Ready(Some(Ok(bytes))) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(std::io::Error::other(e)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

type Manager = Arc<VolumeManager>;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct SendQuery {
    /// The base snapshot (`A`, `@A` or `POOL/VOL@A`) of an incremental stream.
    from: Option<String>,
    /// A resume token: the rest of the stream it names.
    resume: Option<String>,
}

/// `GET /v1/snapshots/{pool}/{vol@snap}/send[?from=A][&resume=TOKEN]`.
#[utoipa::path(get, path = "/v1/snapshots/{pool}/{name}/send", tag = "send", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "VOLUME@SNAPSHOT"), SendQuery), responses((status = 200, description = "The send stream (chunked; its length in the x-strata-stream-bytes header)", body = Vec<u8>, content_type = "application/octet-stream"), (status = 400, description = "Invalid request", body = super::api::ErrorBody), (status = 401, description = "No valid token (TCP)", body = super::api::ErrorBody), (status = 404, description = "No such volume or snapshot", body = super::api::ErrorBody)))]
pub(super) async fn send(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
    query: Result<Query<SendQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Path((pool, name)) = path?;
    let Query(query) = query?;
    let full = format!("{pool}/{name}");
    let planning = manager.clone();
    let job =
        tokio::task::spawn_blocking(move || planning.plan_send(&full, query.from.as_deref(), query.resume.as_deref()))
            .await
            .map_err(|e| ApiError::from(AdminError::Internal(e.to_string())))??;
    let length = job.body_bytes;
    let (sender, receiver) = mpsc::channel(CHANNEL_CHUNKS);
    tokio::spawn(job.run(sender));
    Ok((
        [
            (header::CONTENT_TYPE, STREAM_CONTENT_TYPE.to_string()),
            (
                header::HeaderName::from_static(STREAM_LENGTH_HEADER),
                length.to_string(),
            ),
        ],
        Body::new(ChannelBody(receiver)),
    )
        .into_response())
}

#[derive(Debug, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(super) struct ReceiveQuery {
    /// The body continues a pending receive (`send -t TOKEN`).
    #[serde(default)]
    resume: bool,
}

/// `POST /v1/volumes/{pool}/{name}/receive[?resume=true]`: the body is a
/// send stream. Answers 201 with what was received, or an error whose
/// JSON carries `resume_token` when the receive can be resumed.
#[utoipa::path(post, path = "/v1/volumes/{pool}/{name}/receive", tag = "send", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Volume name"), ReceiveQuery), request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "A send stream"), responses((status = 201, description = "What was received", body = Object), (status = 400, description = "Invalid request", body = super::api::ErrorBody), (status = 401, description = "No valid token (TCP)", body = super::api::ErrorBody), (status = 404, description = "No such volume or snapshot", body = super::api::ErrorBody), (status = 503, description = "A device of the pool failed a write: the receive stays pending (the answer has resume_token)", body = super::api::ErrorBody), (status = 507, description = "The pool has no space left: the receive stays pending (the answer has resume_token)", body = super::api::ErrorBody)))]
pub(super) async fn receive(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
    query: Result<Query<ReceiveQuery>, QueryRejection>,
    body: Body,
) -> Result<Response, ApiError> {
    let Path((pool, name)) = path?;
    let Query(query) = query?;
    let (sender, receiver) = mpsc::channel(CHANNEL_CHUNKS);
    // Once the receive stops taking the body (refused early), the rest is
    // read and dropped: a client still sending would otherwise see the
    // connection reset instead of the answer saying why.
    let pump = tokio::spawn(async move {
        let mut body = body;
        let mut taking = true;
        loop {
            let item = match body.frame().await {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => Ok(data),
                    Err(_) => continue,
                },
                Some(Err(e)) => Err(format!("the connection broke: {e}")),
                None => return,
            };
            let stop = item.is_err();
            if taking && sender.send(item).await.is_err() {
                taking = false;
            }
            if stop {
                return;
            }
        }
    });
    let target = format!("{pool}/{name}");
    let result = manager.receive(&target, query.resume, receiver).await;
    if result.is_err() {
        let _ = pump.await;
    } else {
        pump.abort();
    }
    match result {
        Ok(outcome) => Ok((StatusCode::CREATED, Json(outcome)).into_response()),
        Err(failure) => {
            let status = ApiError::from(failure.error.clone()).status();
            let mut answer = json!({ "error": super::api::one_line(&failure.error.to_string()) });
            if let Some(token) = failure.token {
                answer["resume_token"] = json!(token);
            }
            Ok((status, Json(answer)).into_response())
        }
    }
}

/// `GET /v1/volumes/{pool}/{name}/receive`: the pending receive and its token.
#[utoipa::path(get, path = "/v1/volumes/{pool}/{name}/receive", tag = "send", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Volume name")), responses((status = 200, description = "The pending receive and its resume token", body = Object), (status = 400, description = "Invalid request", body = super::api::ErrorBody), (status = 401, description = "No valid token (TCP)", body = super::api::ErrorBody), (status = 404, description = "No such volume or snapshot", body = super::api::ErrorBody)))]
pub(super) async fn receive_status(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    let Path((pool, name)) = path?;
    let target = format!("{pool}/{name}");
    let status = tokio::task::spawn_blocking(move || manager.receive_status(&target))
        .await
        .map_err(|e| ApiError::from(AdminError::Internal(e.to_string())))??;
    Ok(Json(status).into_response())
}

/// `DELETE /v1/volumes/{pool}/{name}/receive`: discards the pending receive.
#[utoipa::path(delete, path = "/v1/volumes/{pool}/{name}/receive", tag = "send", params(("pool" = String, Path, description = "Pool name"), ("name" = String, Path, description = "Volume name")), responses((status = 204, description = "The pending receive was discarded"), (status = 400, description = "Invalid request", body = super::api::ErrorBody), (status = 401, description = "No valid token (TCP)", body = super::api::ErrorBody), (status = 404, description = "No such volume or snapshot", body = super::api::ErrorBody)))]
pub(super) async fn abort_receive(
    State(manager): State<Manager>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<StatusCode, ApiError> {
    let Path((pool, name)) = path?;
    manager.abort_receive(&format!("{pool}/{name}")).await?;
    Ok(StatusCode::NO_CONTENT)
}
