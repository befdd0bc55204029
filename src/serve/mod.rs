//! Serving many requests with one model: the pieces a server builds on, usable without HTTP.
//! [`prefix`] keeps K/V states of earlier requests so that a prompt starting with the same
//! tokens (a conversation's next turn, a shared system prompt) skips prefilling them.

pub mod prefix;
