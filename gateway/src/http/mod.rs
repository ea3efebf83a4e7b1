//! The HTTP API: axum routes over the engine, one file per job. `app(state)` is the router
//! (tests drive it with `oneshot`, no socket needed); `listen` serves it.
//!
//! Modules depend on `state` and `error` and on each other one way (`openai` on `query`,
//! every route on `middleware`); only this file knows every route.

mod body_budget;
mod documents;
mod error;
pub mod limits;
mod listen;
mod middleware;
pub mod openai;
mod ops;
mod query;
mod routes;
mod state;

pub use error::ApiError;
pub use listen::{runtime, serve, serve_on, spawn_loopback, SHUTDOWN_GRACE};
pub use ops::{openapi, openapi_json_text};
pub use routes::app;
pub use state::{
    AppState, ServerConfig, DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, DEFAULT_MAX_COLLECTION_TOKENS,
    DEFAULT_MAX_REQUEST_TOKENS, DEFAULT_PREFILL_PIECE,
};
