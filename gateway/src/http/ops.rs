//! Operations: `/health`, `/metrics`, the OpenAPI document, the Swagger UI and the web page,
//! and the answers for unknown routes and methods.

use super::documents::{__path_delete_document, __path_list_documents, __path_post_documents};
use super::error::{engine_dropped, ApiError};
use super::openai::in_route_shape;
use super::query::__path_rag_query;
use super::state::AppState;
use crate::api::{CollectionInfo, Health, ModelInfo};
use crate::error::GatewayError;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use utoipa::OpenApi;

/// 404 for a route that does not exist, in its route's shape (an OpenAI client calling an
/// endpoint specrag does not serve gets OpenAI's).
pub(crate) async fn not_found(uri: axum::http::Uri) -> Response {
    let message = if uri.path().starts_with("/v1/") {
        format!(
            "specrag does not serve `{}`: it serves POST /v1/chat/completions and GET \
             /v1/models (see /openapi.json)",
            uri.path()
        )
    } else {
        "no such route; see /openapi.json or /docs".into()
    };
    in_route_shape(
        uri.path(),
        StatusCode::NOT_FOUND,
        "not_found_error",
        message,
    )
}

/// 405 for a method a route does not take, in the route's error shape.
pub(crate) async fn method_not_allowed(uri: axum::http::Uri) -> Response {
    in_route_shape(
        uri.path(),
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "this route does not accept that method; see /openapi.json".into(),
    )
}

pub(crate) fn model_info(m: &target_engine::Model, admin: bool) -> ModelInfo {
    ModelInfo {
        name: m.config().name.clone(),
        path: admin.then(|| m.path().display().to_string()),
        fingerprint: m.fingerprint().to_string(),
        device: None,
    }
}

/// [`model_info`] of the target, with the engine it runs on.
fn target_info(t: &crate::target::Target, admin: bool) -> ModelInfo {
    ModelInfo {
        name: t.config().name.clone(),
        path: admin.then(|| t.path().display().to_string()),
        fingerprint: t.fingerprint().to_string(),
        device: Some(t.device()),
    }
}

/// Liveness, models, collections and queue depth. Open to all; when the server has keys, the
/// collections are those the request's key reaches (none without a key) and model file paths
/// are shown to admin keys only.
#[utoipa::path(
    get,
    path = "/health",
    tag = "operations",
    responses((status = 200, description = "The server is up", body = Health)),
    security((), ("bearer" = []))
)]
pub(crate) async fn health(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<Health>, ApiError> {
    let grant = crate::auth::grant(&state.config.api_keys, &headers);
    let admin = grant.as_ref().is_some_and(|g| g.admin);
    let p = &state.pipeline;
    // Without a key that reaches some, no collection is listed, so none is counted.
    let collections = match grant {
        None => Vec::new(),
        Some(grant) => {
            let pipeline = state.pipeline.clone();
            tokio::task::spawn_blocking(move || pipeline.corpus.index.collections())
                .await
                .map_err(|_| engine_dropped())?
                .map_err(GatewayError::from)?
                .into_iter()
                .filter(|(name, _)| grant.allows(name))
                .map(|(name, chunks)| CollectionInfo { name, chunks })
                .collect()
        }
    };
    let store = store_health(&state.pipeline.corpus, admin);
    Ok(Json(Health {
        status: store.status.clone(),
        store,
        target: target_info(&p.engines.target, admin),
        speculator: p
            .engines
            .spec
            .as_ref()
            .map(|s| model_info(&s.speculator, admin)),
        collections,
        queue_depth: state.engine.depth(),
        queue_capacity: state.engine.capacity(),
        log_position: state.pipeline.corpus.doclog.as_ref().map(|l| l.position()),
        log_failed: state.pipeline.corpus.doclog.as_ref().map(|l| l.failed()),
        log_warnings: state
            .pipeline
            .corpus
            .doclog
            .as_ref()
            .map(|l| l.warnings())
            .filter(|w| !w.is_empty()),
    }))
}

/// The chunk store's part of `/health`.
pub(crate) fn store_health(corpus: &crate::corpus::Corpus, admin: bool) -> crate::api::StoreHealth {
    use chunkstore::ChunkStore;
    let stats = corpus.store.stats();
    let last_error_secs = corpus.store.last_error().map(|t| t.elapsed().as_secs());
    let recent = last_error_secs.is_some_and(|s| s < crate::api::STORE_DEGRADED_SECS);
    let reset = corpus.store_reset.as_ref().map(|p| {
        if admin {
            p.display().to_string()
        } else {
            "moved aside".to_string()
        }
    });
    crate::api::StoreHealth {
        status: if recent || reset.is_some() {
            "degraded"
        } else {
            "ok"
        }
        .into(),
        errors: stats.errors,
        last_error_secs,
        reset_at_startup: reset,
    }
}

/// Prometheus metrics.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses((status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain"))
)]
pub(crate) async fn metrics(State(state): State<AppState>) -> Response {
    use chunkstore::ChunkStore;
    let stats = state.pipeline.corpus.store.stats();
    state
        .metrics
        .body_bytes_in_flight(state.body_budget.in_flight());
    state.metrics.kv_held(
        state.pipeline.kv_held.held(),
        state.pipeline.kv_memory_budget,
    );
    if let crate::target::Target::Device(d) = &state.pipeline.engines.target {
        if let Some(m) = d.memory() {
            state.metrics.device_memory(m.used, m.total);
        }
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(state.engine.depth(), &stats),
    )
        .into_response()
}

/// Adds the bearer security scheme.
pub(crate) struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = api.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "Required on the query and document routes when the server runs with --api-key",
                    ))
                    .build(),
            ),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "specrag",
        description = "RAG serving gateway with selective KV-cache reuse: chunk KV is precomputed at ingestion and reused at query time; a small speculative model picks the tokens the target model recomputes.",
        license(name = "Apache-2.0")
    ),
    paths(
        rag_query,
        post_documents,
        list_documents,
        delete_document,
        health,
        metrics,
        crate::http::openai::chat_completions,
        crate::http::openai::list_models
    ),
    modifiers(&Security),
    tags(
        (name = "query", description = "Answering questions"),
        (name = "documents", description = "Filling and inspecting collections"),
        (name = "openai", description = "OpenAI-compatible chat completions over a collection"),
        (name = "operations", description = "Health and metrics")
    )
)]
pub(crate) struct ApiDoc;

/// The OpenAPI document.
pub fn openapi() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The OpenAPI document as pretty JSON (what `specrag openapi` prints and
/// `docs/openapi.json` holds).
pub fn openapi_json_text() -> String {
    openapi().to_pretty_json().unwrap_or_default()
}

pub(crate) async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        openapi_json_text(),
    )
        .into_response()
}

pub(crate) const SWAGGER_JS: &[u8] = include_bytes!("../../assets/swagger-ui/swagger-ui-bundle.js");
pub(crate) const SWAGGER_CSS: &[u8] = include_bytes!("../../assets/swagger-ui/swagger-ui.css");
pub(crate) const SWAGGER_ICON: &[u8] = include_bytes!("../../assets/swagger-ui/favicon-32x32.png");

/// The web page: ask a collection, watch the answer stream, its sources, TTFT split and reuse,
/// and compare with full recompute. Served from the binary (no network at run time); it asks
/// for an API key when the server answers 401.
pub(crate) async fn web_page() -> Html<&'static str> {
    Html(include_str!("../../assets/web/index.html"))
}

pub(crate) async fn docs_index() -> Html<&'static str> {
    Html(
        r##"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>specrag API</title>
<link rel="stylesheet" href="/docs/swagger-ui.css">
<link rel="icon" type="image/png" href="/docs/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({ url: "/openapi.json", dom_id: "#swagger-ui" });
</script>
</body>
</html>
"##,
    )
}

pub(crate) async fn docs_asset(Path(file): Path<String>) -> Result<Response, ApiError> {
    let (body, ty) = match file.as_str() {
        "swagger-ui-bundle.js" => (SWAGGER_JS, "application/javascript"),
        "swagger-ui.css" => (SWAGGER_CSS, "text/css"),
        "favicon-32x32.png" => (SWAGGER_ICON, "image/png"),
        _ => {
            return Err(ApiError::Gateway(GatewayError::NotFound(format!(
                "no such file /docs/{file}"
            ))))
        }
    };
    Ok((
        [
            (header::CONTENT_TYPE, ty),
            (header::CACHE_CONTROL, "public, max-age=86400"),
        ],
        body,
    )
        .into_response())
}
