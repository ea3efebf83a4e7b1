//! The router: every route, its body limit and its layers (request limits inside the
//! request log).

use super::documents::{delete_document, list_documents, post_documents};
use super::middleware::{observe, require_key};
use super::ops::{
    docs_asset, docs_index, health, method_not_allowed, metrics, not_found, openapi_json, web_page,
};
use super::query::rag_query;
use super::state::{AppState, DOCUMENTS_BODY_LIMIT, OPENAI_BODY_LIMIT, QUERY_BODY_LIMIT};
use axum::extract::DefaultBodyLimit;
use axum::routing::{delete, get, post};
use axum::Router;

/// The router (tests drive it with `oneshot`, no socket needed).
pub fn app(state: AppState) -> Router {
    let protected = Router::new()
        .route(
            "/rag/query",
            post(rag_query).layer(DefaultBodyLimit::max(QUERY_BODY_LIMIT)),
        )
        .route(
            "/documents",
            post(post_documents)
                .layer(DefaultBodyLimit::max(DOCUMENTS_BODY_LIMIT))
                .get(list_documents),
        )
        .route("/documents/{id}", delete(delete_document))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_key,
        ));
    // The OpenAI routes check keys with their own layer: their errors have OpenAI's shape.
    let openai = Router::new()
        .route(
            "/v1/chat/completions",
            post(crate::http::openai::chat_completions)
                .layer(DefaultBodyLimit::max(OPENAI_BODY_LIMIT)),
        )
        .route("/v1/models", get(crate::http::openai::list_models))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::http::openai::require_key,
        ));
    Router::new()
        .merge(protected)
        .merge(openai)
        .route("/", get(web_page))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi_json))
        .route("/docs", get(docs_index))
        .route("/docs/", get(docs_index))
        .route("/docs/{file}", get(docs_asset))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::http::limits::limits,
        ))
        .layer(axum::middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}
