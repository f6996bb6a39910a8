//! Any byte string as a response body: decoding and conversion to markdown and text
//! must return (an error is fine) without panicking, overflowing the stack, or taking
//! time that grows faster than the page (libFuzzer's -timeout catches that).
#![no_main]

use airlock_worker_http::html::{Flavor, body_text, decode, html_to};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = body_text(data, Some("text/html"), false);
    let text = decode(data, Some("text/html"), false);
    for flavor in [Flavor::Markdown, Flavor::Text] {
        let _ = html_to(&text, flavor, None);
    }
});
