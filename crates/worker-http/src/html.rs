//! Response bodies as text: charset detection and decoding, and HTML turned into
//! readable markdown or plain text (scripts, styles and other non-content dropped).

use encoding_rs::{Encoding, UTF_8};
use scraper::{ElementRef, Html, Node};
use url::Url;

mod bounded;
use bounded::parse_within_depth;

/// The media type of a `Content-Type` value, lower case, without parameters.
pub fn media_type(content_type: Option<&str>) -> Option<String> {
    let ct = content_type?;
    let mt = ct.split(';').next()?.trim().to_ascii_lowercase();
    (!mt.is_empty()).then_some(mt)
}

/// The `charset` parameter of a `Content-Type` value.
fn charset_param(content_type: &str) -> Option<&'static Encoding> {
    content_type.split(';').skip(1).find_map(|param| {
        let (k, v) = param.split_once('=')?;
        (k.trim().eq_ignore_ascii_case("charset"))
            .then(|| Encoding::for_label(v.trim().trim_matches(['"', '\'']).as_bytes()))
            .flatten()
    })
}

/// The charset a `<meta charset>` or `<meta http-equiv=content-type content=...>` tag
/// in the first 4 KiB of an HTML document declares.
fn meta_charset(body: &[u8]) -> Option<&'static Encoding> {
    let head = &body[..body.len().min(4096)];
    let lower: Vec<u8> = head.to_ascii_lowercase();
    let mut rest = lower.as_slice();
    while let Some(i) = find(rest, b"<meta") {
        let tag_start = &rest[i + 5..];
        let end = tag_start
            .iter()
            .position(|&b| b == b'>')
            .unwrap_or(tag_start.len());
        let tag = &tag_start[..end];
        if let Some(j) = find(tag, b"charset") {
            let mut v = &tag[j + 7..];
            v = trim_start(v);
            if let Some(after_eq) = v.strip_prefix(b"=") {
                let v = trim_start(after_eq);
                let v = v
                    .strip_prefix(b"\"")
                    .or_else(|| v.strip_prefix(b"'"))
                    .unwrap_or(v);
                let len = v
                    .iter()
                    .position(|b| !(b.is_ascii_alphanumeric() || b"-_:.".contains(b)))
                    .unwrap_or(v.len());
                if let Some(enc) = Encoding::for_label(&v[..len]) {
                    // A document that the byte-level prescan could read is not UTF-16.
                    let utf16 = enc == encoding_rs::UTF_16LE || enc == encoding_rs::UTF_16BE;
                    return Some(if utf16 { UTF_8 } else { enc });
                }
            }
        }
        rest = &tag_start[end..];
    }
    None
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn trim_start(v: &[u8]) -> &[u8] {
    let n = v.iter().take_while(|b| b.is_ascii_whitespace()).count();
    &v[n..]
}

/// Is the media type HTML?
pub fn is_html(media: Option<&str>) -> bool {
    matches!(media, Some("text/html" | "application/xhtml+xml"))
}

/// Is the media type text of some kind (so that a body is decoded, never base64)?
pub fn is_textual(media: &str) -> bool {
    let (kind, sub) = media.split_once('/').unwrap_or((media, ""));
    kind == "text"
        || sub.ends_with("+json")
        || sub.ends_with("+xml")
        || matches!(
            sub,
            "json"
                | "xml"
                | "javascript"
                | "ecmascript"
                | "x-javascript"
                | "x-www-form-urlencoded"
                | "yaml"
                | "x-yaml"
                | "toml"
                | "graphql"
                | "csv"
                | "x-ndjson"
                | "ndjson"
                | "sql"
        )
}

/// The encoding of a text body: byte-order mark, then the `Content-Type` charset, then
/// (for HTML) a `<meta>` declaration, then UTF-8.
pub fn detect_encoding(body: &[u8], content_type: Option<&str>) -> &'static Encoding {
    if let Some((enc, _)) = Encoding::for_bom(body) {
        return enc;
    }
    if let Some(enc) = content_type.and_then(charset_param) {
        return enc;
    }
    if (is_html(media_type(content_type).as_deref()) || content_type.is_none())
        && let Some(enc) = meta_charset(body)
    {
        return enc;
    }
    UTF_8
}

/// Decodes a text body (invalid sequences become U+FFFD). A multi-byte character cut by
/// truncation at the very end is dropped rather than shown as U+FFFD.
pub fn decode(body: &[u8], content_type: Option<&str>, truncated: bool) -> String {
    let enc = detect_encoding(body, content_type);
    let body = if truncated && enc == UTF_8 {
        match std::str::from_utf8(body) {
            Err(e) if e.error_len().is_none() => &body[..e.valid_up_to()],
            _ => body,
        }
    } else {
        body
    };
    enc.decode(body).0.into_owned()
}

/// A body as the http_request result shows it: text when the media type is textual or
/// the bytes are clean UTF-8, otherwise `None` (the caller base64-encodes it).
pub fn body_text(body: &[u8], content_type: Option<&str>, truncated: bool) -> Option<String> {
    let media = media_type(content_type);
    if media.as_deref().is_some_and(is_textual) {
        return Some(decode(body, content_type, truncated));
    }
    let has_charset = content_type.and_then(charset_param).is_some();
    if has_charset {
        return Some(decode(body, content_type, truncated));
    }
    let valid = match std::str::from_utf8(body) {
        Ok(_) => body,
        Err(e) if truncated && e.error_len().is_none() => &body[..e.valid_up_to()],
        Err(_) => return None,
    };
    let text = std::str::from_utf8(valid).ok()?;
    (!text.contains('\0')).then(|| text.to_owned())
}

/// Output flavour of [`html_to`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    Markdown,
    Text,
}

/// Elements whose content is never shown.
const SKIPPED: &[&str] = &[
    "script", "style", "noscript", "template", "head", "svg", "math", "canvas", "iframe", "object",
    "embed", "select", "button", "input", "textarea", "link", "meta", "base",
];

/// Elements that start and end a block.
const BLOCKS: &[&str] = &[
    "address",
    "article",
    "aside",
    "body",
    "center",
    "details",
    "dialog",
    "dd",
    "div",
    "dl",
    "dt",
    "fieldset",
    "figcaption",
    "figure",
    "footer",
    "form",
    "header",
    "hgroup",
    "html",
    "main",
    "nav",
    "p",
    "section",
    "summary",
    "caption",
];

/// Deepest element nesting rendered with structure; deeper content becomes plain text.
/// The converter recurses once per nesting level, and a page is free to nest 20 000
/// `<div>`s: without a bound one page overflows the worker thread's stack and aborts the
/// process, failing every tenant's calls. 64 levels of structure is beyond what markdown
/// can show and well within a worker thread's 2 MiB stack, even in a debug build.
const MAX_DEPTH: usize = 64;

struct Converter<'a> {
    flavor: Flavor,
    base: Option<&'a Url>,
    /// Current element nesting depth (see [`MAX_DEPTH`]).
    depth: std::cell::Cell<usize>,
}

/// Inline content being gathered into one paragraph.
#[derive(Default)]
struct Inline {
    text: String,
}

impl Inline {
    /// Appends text with HTML whitespace collapsed to single spaces.
    fn push_text(&mut self, s: &str) {
        for (i, part) in s.split(|c: char| c.is_ascii_whitespace()).enumerate() {
            if i > 0 && !self.text.ends_with([' ', '\n']) && !self.text.is_empty() {
                self.text.push(' ');
            }
            self.text.push_str(&part.replace('\u{a0}', " "));
        }
    }

    fn push_raw(&mut self, s: &str) {
        self.text.push_str(s);
    }

    fn take(&mut self) -> Option<String> {
        let text = std::mem::take(&mut self.text);
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        let joined = lines.join("\n");
        let t = joined.trim();
        (!t.is_empty()).then(|| t.to_owned())
    }
}

impl Converter<'_> {
    fn md(&self) -> bool {
        self.flavor == Flavor::Markdown
    }

    fn link(&self, href: &str) -> Option<String> {
        let href = href.trim();
        if href.is_empty() || href.starts_with('#') {
            return None;
        }
        let lower = href.to_ascii_lowercase();
        if lower.starts_with("javascript:") || lower.starts_with("data:") {
            return None;
        }
        Some(match self.base.and_then(|b| b.join(href).ok()) {
            Some(u) => u.to_string(),
            None => href.to_owned(),
        })
    }

    /// Renders the children of `el` as blocks into `out`.
    fn blocks(&self, el: ElementRef<'_>, out: &mut Vec<String>) {
        let mut inline = Inline::default();
        for child in el.children() {
            match child.value() {
                Node::Text(t) => inline.push_text(t),
                Node::Element(_) => {
                    if let Some(c) = ElementRef::wrap(child) {
                        self.element(c, &mut inline, out);
                    }
                }
                _ => {}
            }
        }
        out.extend(inline.take());
    }

    /// Renders one element: inline ones into `inline`, block ones (after flushing the
    /// paragraph gathered so far) into `out`. Beyond [`MAX_DEPTH`] the element's text is
    /// kept (gathered without recursion) and its structure dropped.
    fn element(&self, el: ElementRef<'_>, inline: &mut Inline, out: &mut Vec<String>) {
        let depth = self.depth.get();
        if depth >= MAX_DEPTH {
            plain_text(el, inline);
            return;
        }
        self.depth.set(depth + 1);
        self.element_at_depth(el, inline, out);
        self.depth.set(depth);
    }

    fn element_at_depth(&self, el: ElementRef<'_>, inline: &mut Inline, out: &mut Vec<String>) {
        let name = el.value().name();
        if SKIPPED.contains(&name) || el.value().attr("hidden").is_some() {
            return;
        }
        let block = |inline: &mut Inline, out: &mut Vec<String>, rendered: Vec<String>| {
            out.extend(inline.take());
            out.extend(rendered);
        };
        match name {
            "h1" | "h2" | "h3" | "h4" | "h5" | "h6" => {
                let level = usize::from(name.as_bytes()[1] - b'0');
                let text = self.inline_of(el);
                let rendered = text
                    .map(|t| {
                        let t = t.replace('\n', " ");
                        if self.md() {
                            format!("{} {t}", "#".repeat(level))
                        } else {
                            t
                        }
                    })
                    .into_iter()
                    .collect();
                block(inline, out, rendered);
            }
            "ul" | "ol" | "menu" => {
                let rendered = self.list(el, name == "ol");
                block(inline, out, rendered.into_iter().collect());
            }
            "pre" => {
                let text: String = el.text().collect();
                let text = text.trim_matches('\n').to_owned();
                let rendered = if text.trim().is_empty() {
                    vec![]
                } else if self.md() {
                    vec![format!("```\n{text}\n```")]
                } else {
                    vec![text]
                };
                block(inline, out, rendered);
            }
            "blockquote" => {
                let mut inner = Vec::new();
                self.blocks(el, &mut inner);
                let prefix = if self.md() { "> " } else { "  " };
                let quoted = prefix_lines(&inner.join("\n\n"), prefix, prefix);
                block(inline, out, vec![quoted]);
            }
            "hr" => block(
                inline,
                out,
                vec![if self.md() { "---" } else { "----" }.into()],
            ),
            "table" => {
                let rendered = self.table(el);
                block(inline, out, rendered.into_iter().collect());
            }
            "li" | "tr" | "thead" | "tbody" | "tfoot" => {
                // Stray list items or rows outside their container: plain blocks.
                let mut inner = Vec::new();
                self.blocks(el, &mut inner);
                block(inline, out, inner);
            }
            _ if BLOCKS.contains(&name) => {
                let mut inner = Vec::new();
                self.blocks(el, &mut inner);
                block(inline, out, inner);
            }
            _ => self.inline(el, inline, out),
        }
    }

    /// Inline elements. A block nested inside an inline one still becomes a block.
    fn inline(&self, el: ElementRef<'_>, inline: &mut Inline, out: &mut Vec<String>) {
        let name = el.value().name();
        let md = self.md();
        match name {
            "br" => inline.push_raw("\n"),
            "img" => {
                let alt = el
                    .value()
                    .attr("alt")
                    .unwrap_or("")
                    .trim()
                    .replace('\n', " ");
                match (md, el.value().attr("src").and_then(|s| self.link(s))) {
                    (true, Some(src)) => inline.push_raw(&format!("![{alt}]({src})")),
                    _ if !alt.is_empty() => inline.push_text(&alt),
                    _ => {}
                }
            }
            "a" => {
                let text = self.inline_of(el).unwrap_or_default().replace('\n', " ");
                let href = el.value().attr("href").and_then(|h| self.link(h));
                match (md, href) {
                    (true, Some(href)) if !text.is_empty() => {
                        inline.push_raw(&format!("[{text}]({href})"));
                    }
                    (true, Some(href)) => inline.push_raw(&format!("<{href}>")),
                    _ => inline.push_text(&text),
                }
            }
            "strong" | "b" | "em" | "i" | "code" | "kbd" | "samp" | "tt" | "del" | "s"
            | "strike" => {
                let text = self.inline_of(el).unwrap_or_default();
                let mark = match name {
                    _ if !md || text.is_empty() => "",
                    "strong" | "b" => "**",
                    "em" | "i" => "*",
                    "del" | "s" | "strike" => "~~",
                    _ => "`",
                };
                inline.push_raw(&format!("{mark}{text}{mark}"));
            }
            _ => {
                for child in el.children() {
                    match child.value() {
                        Node::Text(t) => inline.push_text(t),
                        Node::Element(_) => {
                            if let Some(c) = ElementRef::wrap(child) {
                                self.element(c, inline, out);
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }

    /// The inline content of an element, rendered as one paragraph.
    fn inline_of(&self, el: ElementRef<'_>) -> Option<String> {
        let mut inner = Vec::new();
        self.blocks(el, &mut inner);
        let joined = inner.join(" ");
        let t = joined.trim();
        (!t.is_empty()).then(|| t.to_owned())
    }

    fn list(&self, el: ElementRef<'_>, ordered: bool) -> Option<String> {
        let start: usize = el
            .value()
            .attr("start")
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1);
        let mut items = Vec::new();
        for child in el.children() {
            let Some(item) = ElementRef::wrap(child) else {
                continue;
            };
            let mut inner = Vec::new();
            if item.value().name() == "li" {
                self.blocks(item, &mut inner);
            } else {
                let mut inline = Inline::default();
                self.element(item, &mut inline, &mut inner);
                inner.extend(inline.take());
            }
            if inner.is_empty() {
                continue;
            }
            let marker = if ordered {
                format!("{}. ", start + items.len())
            } else {
                "- ".to_owned()
            };
            let indent = " ".repeat(marker.len());
            items.push(prefix_lines(&inner.join("\n"), &marker, &indent));
        }
        (!items.is_empty()).then(|| items.join("\n"))
    }

    fn table(&self, el: ElementRef<'_>) -> Option<String> {
        let mut rows: Vec<Vec<String>> = Vec::new();
        let mut caption = None;
        collect_rows(
            el,
            &mut |row| {
                let cells: Vec<String> = row
                    .children()
                    .filter_map(ElementRef::wrap)
                    .filter(|c| matches!(c.value().name(), "td" | "th"))
                    .map(|c| {
                        self.inline_of(c)
                            .unwrap_or_default()
                            .replace('\n', " ")
                            .replace('|', "\\|")
                    })
                    .collect();
                if !cells.is_empty() {
                    rows.push(cells);
                }
            },
            &mut |cap| caption = self.inline_of(cap),
        );
        if rows.is_empty() {
            return caption;
        }
        let width = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut lines = Vec::new();
        if let Some(c) = caption {
            lines.push(c);
        }
        for (i, row) in rows.iter().enumerate() {
            let mut cells = row.clone();
            cells.resize(width, String::new());
            if self.md() {
                lines.push(format!("| {} |", cells.join(" | ")));
                if i == 0 {
                    lines.push(format!("|{}", " --- |".repeat(width)));
                }
            } else {
                lines.push(cells.join(" | "));
            }
        }
        Some(lines.join("\n"))
    }
}

/// The text below `el` without recursion (a walk over the tree's open/close edges),
/// leaving out what the converter skips (scripts, styles, hidden elements).
fn plain_text(el: ElementRef<'_>, inline: &mut Inline) {
    use ego_tree::iter::Edge;
    let skipped = |node: &ego_tree::NodeRef<'_, Node>| {
        node.value()
            .as_element()
            .is_some_and(|e| SKIPPED.contains(&e.name()) || e.attr("hidden").is_some())
    };
    // Depth inside skipped elements; text counts only at zero.
    let mut inside_skipped = 0usize;
    for edge in el.traverse() {
        match edge {
            Edge::Open(node) if skipped(&node) => inside_skipped += 1,
            Edge::Close(node) if skipped(&node) => {
                inside_skipped = inside_skipped.saturating_sub(1)
            }
            Edge::Open(node) if inside_skipped == 0 => {
                if let Node::Text(text) = node.value() {
                    inline.push_text(text);
                }
            }
            _ => {}
        }
    }
}

/// Visits the rows of a table (through thead/tbody/tfoot, not into nested tables).
fn collect_rows<'a>(
    el: ElementRef<'a>,
    row: &mut dyn FnMut(ElementRef<'a>),
    caption: &mut dyn FnMut(ElementRef<'a>),
) {
    collect_rows_below(el, row, caption, 0);
}

fn collect_rows_below<'a>(
    el: ElementRef<'a>,
    row: &mut dyn FnMut(ElementRef<'a>),
    caption: &mut dyn FnMut(ElementRef<'a>),
    depth: usize,
) {
    for child in el.children().filter_map(ElementRef::wrap) {
        match child.value().name() {
            "tr" => row(child),
            // Row groups nest only when the tree was built by hand, never by the
            // parser; the bound keeps even that flat.
            "thead" | "tbody" | "tfoot" if depth < MAX_DEPTH => {
                collect_rows_below(child, row, caption, depth + 1)
            }
            "caption" => caption(child),
            _ => {}
        }
    }
}

/// Prefixes the first line with `first` and every other non-empty line with `rest`.
fn prefix_lines(text: &str, first: &str, rest: &str) -> String {
    let mut out = String::new();
    for (i, line) in text.lines().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        if i == 0 {
            out.push_str(first);
        } else if !line.is_empty() {
            out.push_str(rest);
        } else {
            out.push_str(rest.trim_end());
        }
        out.push_str(line);
    }
    out
}

/// The document's `<title>`.
fn title(doc: &Html) -> Option<String> {
    let sel = scraper::Selector::parse("title").ok()?;
    let t: String = doc.select(&sel).next()?.text().collect();
    let t = t.split_whitespace().collect::<Vec<_>>().join(" ");
    (!t.is_empty()).then_some(t)
}

/// A page nested deeper than [`MAX_PAGE_NESTING`]: refused, its parsing stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the page nests elements more than {MAX_PAGE_NESTING} levels deep, which no real document \
     does; it is not converted"
)]
pub struct TooDeep;

/// Deepest element nesting a page may have to be converted at all. The HTML parser's
/// scope checks walk its stack of open elements for most start tags, so its cost grows
/// with the page's length times its nesting depth: a few MiB of unclosed `<div>`s would
/// keep a worker thread busy for minutes. Real pages stay far below this.
pub const MAX_PAGE_NESTING: usize = 512;

/// Converts an HTML document to markdown or plain text. Links and images are resolved
/// against `base` (the final URL). The title, when the body does not start with the
/// same heading, comes first. Pages nested deeper than [`MAX_PAGE_NESTING`] are refused.
pub fn html_to(html: &str, flavor: Flavor, base: Option<&Url>) -> Result<String, TooDeep> {
    let doc = parse_within_depth(html, MAX_PAGE_NESTING).ok_or(TooDeep)?;
    let conv = Converter {
        flavor,
        base,
        depth: std::cell::Cell::new(0),
    };
    let mut blocks = Vec::new();
    conv.blocks(doc.root_element(), &mut blocks);
    if let Some(t) = title(&doc) {
        let first = blocks.first().map(|b| b.trim_start_matches('#').trim());
        if first != Some(t.as_str()) {
            let heading = match flavor {
                Flavor::Markdown => format!("# {t}"),
                Flavor::Text => t,
            };
            blocks.insert(0, heading);
        }
    }
    Ok(blocks.join("\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Converts on a thread with the stack of a worker thread (2 MiB, tokio's default),
    /// so a converter that recursed once per nesting level would overflow it.
    fn convert_on_small_stack(html: String, flavor: Flavor) -> Result<String, TooDeep> {
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || html_to(&html, flavor, None))
            .expect("spawn")
            .join()
            .expect("the converter must not crash")
    }

    fn nested(open: &str, close: &str, levels: usize, inner: &str) -> String {
        format!(
            "<html><body>{}{inner}{}</body></html>",
            open.repeat(levels),
            close.repeat(levels)
        )
    }

    /// Pages an attacker would write to nest deeper than the parser can afford, with
    /// the variations that slip past a naive tag count; `levels` nested elements each.
    fn hostile_pages(levels: usize) -> Vec<(&'static str, String)> {
        let pairs = levels.div_ceil(2);
        vec![
            ("div", nested("<div>", "</div>", levels, "deepest")),
            ("span", nested("<span>", "</span>", levels, "deepest")),
            (
                "blockquote",
                nested("<blockquote>", "</blockquote>", levels, "deepest"),
            ),
            ("lists", nested("<ul><li>", "</li></ul>", pairs, "deepest")),
            (
                "emphasis",
                nested("<strong><em>", "</em></strong>", pairs, "deepest"),
            ),
            // A table's row goes in an implied tbody: four elements a level.
            (
                "tables",
                nested(
                    "<table><tr><td>",
                    "</td></tr></table>",
                    levels.div_ceil(4),
                    "deepest",
                ),
            ),
            (
                "unclosed",
                format!("<body>{}deepest", "<div><span>".repeat(pairs)),
            ),
            // `/>` does not close an HTML element.
            (
                "self-closing div",
                format!("<body>{}deepest", "<div/>".repeat(levels)),
            ),
            // Stray end tags close nothing.
            (
                "stray end tags",
                format!("<body>{}deepest", "<div></x></p>".repeat(levels)),
            ),
            // A div breaks out of SVG, self-closing or not.
            (
                "svg breakout",
                format!("<body><svg>{}deepest", "<div/>".repeat(levels)),
            ),
            (
                "upper case",
                format!("<BODY>{}deepest", "<DIV CLASS=a>".repeat(levels)),
            ),
            // The tokenizer also ends a comment at `--!>`.
            (
                "comment ended by --!>",
                format!("<body><!----!>{}deepest", "<div>".repeat(levels)),
            ),
            // Outside <ruby> nothing closes rt, rb or rp.
            (
                "rt outside ruby",
                format!("<body>{}deepest", "<rt>".repeat(levels)),
            ),
            (
                "rb outside ruby",
                format!("<body>{}deepest", "<rb>".repeat(levels)),
            ),
            // In SVG a style holds markup; the div then leaves the SVG.
            (
                "style in svg",
                format!("<body><svg><style>{}deepest", "<div>".repeat(levels)),
            ),
            (
                "title in math",
                format!("<body><math><title>{}deepest", "<div>".repeat(levels)),
            ),
            // Back in HTML a style is text again, and `<!--` in it no comment.
            (
                "style after leaving svg",
                format!(
                    "<body><svg><div><style><!--</style>{}deepest-->",
                    "<div>".repeat(levels)
                ),
            ),
            // A quoted attribute value may hold `>` and end tags.
            (
                "quoted >",
                format!("<body>{}deepest", "<div title='></div>'>".repeat(levels)),
            ),
            // `<!x`, `<?x` and `</ x` are comments up to the next `>`.
            (
                "bogus comments",
                format!(
                    "<body>{}deepest",
                    "<div><!x </div><?x </div></ </div>".repeat(levels)
                ),
            ),
            // Only `</style` then a space, `/` or `>` ends a style.
            (
                "not the style's end tag",
                format!(
                    "<body>{}deepest",
                    "<div><style></stylex></div></style>".repeat(levels)
                ),
            ),
            (
                "iframe text",
                format!(
                    "<body><iframe><!--</iframe>{}deepest-->",
                    "<div>".repeat(levels)
                ),
            ),
            // In a script, `<!--<script>` hides the next `</script>`.
            (
                "escaped script",
                format!(
                    "<body>{}deepest",
                    "<div><script><!--<script></script></div></script>".repeat(levels)
                ),
            ),
            // An end tag does not close past a special element, nor does </body>.
            (
                "misnested end tags",
                format!("<body>{}deepest", "<span><div></span>".repeat(pairs)),
            ),
            (
                "end of body",
                format!(
                    "<body>{}deepest",
                    format!("{}</body><body>", "<div>".repeat(pairs)).repeat(2)
                ),
            ),
        ]
    }

    /// Pages whose deep part the converter drops (SVG content, frame sets), so they only
    /// show the refusal.
    fn hostile_pages_without_text(levels: usize) -> Vec<(&'static str, String)> {
        vec![
            // Formatting elements closed by a block's end are reopened by the parser in
            // the next one: 50 a round, the page's own nesting two.
            (
                "reopened formatting",
                "<div>".to_owned()
                    + &format!(
                        "<div>{}</div>x",
                        (0..50).map(|k| format!("<b id={k}>")).collect::<String>()
                    )
                    .repeat(levels / 50 + 2),
            ),
            // The adoption agency moves a block's children under a formatting element
            // it has not attached yet: they must be measured where they end up.
            (
                "adoption agency",
                format!(
                    "<body>{}",
                    format!("<b>{}</b>", "<div>".repeat(9)).repeat(levels / 9 + 2)
                ),
            ),
            // `p` and `li` around an SVG integration point.
            (
                "integration point",
                format!(
                    "<body><svg><foreignObject><p></foreignObject><style><!--</style>{}-->",
                    "<div>".repeat(levels)
                ),
            ),
            // `/>` closes an SVG element only right after its name or a value.
            (
                "svg />",
                format!("<body><svg>{}", "<g x=a/>".repeat(levels)),
            ),
            // In SVG, HTML's void and implied-end names are ordinary elements.
            (
                "svg area",
                format!("<body><svg>{}", "<area>".repeat(levels)),
            ),
            (
                "math option",
                format!("<body><math>{}", "<option>".repeat(levels)),
            ),
            // A frame set ignores a style's start tag, so its text is markup.
            (
                "frameset style",
                format!("<frameset><style>{}", "<frameset>".repeat(levels)),
            ),
        ]
    }

    #[test]
    fn pages_nested_past_the_limit_are_refused_before_parsing() {
        // The page of the report: 20 000 nested divs, about 220 KB.
        let report = nested("<div>", "</div>", 20_000, "deepest");
        assert_eq!(html_to(&report, Flavor::Markdown, None), Err(TooDeep));
        let pages = hostile_pages(MAX_PAGE_NESTING + 2)
            .into_iter()
            .chain(hostile_pages_without_text(MAX_PAGE_NESTING + 2));
        for (what, page) in pages {
            for flavor in [Flavor::Markdown, Flavor::Text] {
                assert_eq!(
                    convert_on_small_stack(page.clone(), flavor),
                    Err(TooDeep),
                    "{what}"
                );
            }
        }
    }

    #[test]
    fn pages_just_within_the_limit_convert_on_a_small_stack_with_their_text() {
        for (what, page) in hostile_pages(MAX_PAGE_NESTING - 8) {
            for flavor in [Flavor::Markdown, Flavor::Text] {
                let text = convert_on_small_stack(page.clone(), flavor)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(
                    text.contains("deepest"),
                    "{what}: the text is kept: {text:.200}"
                );
            }
        }
    }

    #[test]
    fn wide_real_world_shapes_are_not_mistaken_for_deep_ones() {
        // Thousands of siblings, unclosed paragraphs and list items, void elements,
        // self-closing SVG paths and comments or scripts full of tags.
        let page = format!(
            "<body>{}{}{}<svg>{}</svg><!-- {} --><script>{}</script><ul>{}</ul>end",
            "<div>x</div>".repeat(5_000),
            "<p>para".repeat(2_000),
            "<br><img src=a><hr>".repeat(2_000),
            "<path d='M0 0'/>".repeat(2_000),
            "<div>".repeat(2_000),
            "document.write('<div>');".repeat(2_000),
            "<li>item".repeat(2_000),
        );
        let text = html_to(&page, Flavor::Text, None).expect("converts");
        assert!(
            text.ends_with("end"),
            "{:.200}",
            &text[text.len().saturating_sub(200)..]
        );
    }

    #[test]
    fn structure_is_kept_up_to_the_depth_bound() {
        let page = nested(
            "<div>",
            "</div>",
            MAX_DEPTH - 10,
            "<h2>Title</h2><ul><li>one</li></ul>",
        );
        let md = convert_on_small_stack(page, Flavor::Markdown).expect("converts");
        assert!(md.contains("## Title") && md.contains("- one"), "{md}");
        let deeper = nested(
            "<div>",
            "</div>",
            MAX_DEPTH + 10,
            "<h2>Title</h2><script>x()</script>",
        );
        let md = convert_on_small_stack(deeper, Flavor::Markdown).expect("converts");
        assert_eq!(
            md, "Title",
            "beyond the bound: plain text, scripts still skipped"
        );
    }

    #[test]
    fn charset_detection() {
        assert_eq!(
            detect_encoding(b"x", Some("text/html; charset=ISO-8859-1")).name(),
            "windows-1252"
        );
        assert_eq!(detect_encoding(b"x", Some("text/plain")), UTF_8);
        let meta = b"<html><head><meta charset=\"latin1\"></head>";
        assert_eq!(
            detect_encoding(meta, Some("text/html")).name(),
            "windows-1252"
        );
        let equiv = b"<meta http-equiv='Content-Type' content='text/html; charset=Shift_JIS'>";
        assert_eq!(
            detect_encoding(equiv, Some("text/html")).name(),
            "Shift_JIS"
        );
        assert_eq!(
            detect_encoding(b"\xef\xbb\xbfhi", Some("text/html; charset=latin1")),
            UTF_8
        );
        assert_eq!(
            decode(b"caf\xe9", Some("text/plain; charset=iso-8859-1"), false),
            "café"
        );
        assert_eq!(decode("café".as_bytes(), Some("text/plain"), false), "café");
        assert_eq!(decode(&"café".as_bytes()[..4], None, true), "caf");
    }

    #[test]
    fn binary_or_text() {
        assert_eq!(
            body_text(b"{\"a\":1}", Some("application/json"), false).as_deref(),
            Some("{\"a\":1}")
        );
        assert_eq!(body_text(b"hello", None, false).as_deref(), Some("hello"));
        assert!(body_text(b"\x89PNG\r\n\x1a\n\0\0", Some("image/png"), false).is_none());
        assert!(body_text(b"a\0b", Some("application/octet-stream"), false).is_none());
        assert!(body_text(b"\xff\xfe\xfd", None, false).is_none());
    }

    #[test]
    fn markdown_and_text() {
        let html = r#"<!doctype html><html><head><title>Menu</title><style>p{color:red}</style>
            <script>alert("x")</script></head><body>
            <h1>Café   du  Monde</h1>
            <p>Fresh <b>beignets</b> and <a href="/coffee?x=1">coffee</a>.<br>Open daily.</p>
            <ul><li>One</li><li>Two <i>items</i><ul><li>Nested</li></ul></li></ul>
            <ol start="3"><li>Three</li><li>Four</li></ol>
            <pre>let x = 1;
  indented</pre>
            <table><tr><th>A</th><th>B</th></tr><tr><td>1</td><td>2</td></tr></table>
            <blockquote><p>Quote</p></blockquote>
            <noscript>enable js</noscript><div hidden>secret</div>
            </body></html>"#;
        let base = Url::parse("https://example.com/menu/").unwrap();
        let md = html_to(html, Flavor::Markdown, Some(&base)).expect("converts");
        assert!(md.starts_with("# Menu\n\n# Café du Monde\n\n"), "{md}");
        assert!(
            md.contains(
                "Fresh **beignets** and [coffee](https://example.com/coffee?x=1).\nOpen daily."
            ),
            "{md}"
        );
        assert!(md.contains("- One\n- Two *items*\n  - Nested"), "{md}");
        assert!(md.contains("3. Three\n4. Four"), "{md}");
        assert!(md.contains("```\nlet x = 1;\n  indented\n```"), "{md}");
        assert!(md.contains("| A | B |\n| --- | --- |\n| 1 | 2 |"), "{md}");
        assert!(md.contains("> Quote"), "{md}");
        for gone in ["alert", "color:red", "enable js", "secret"] {
            assert!(!md.contains(gone), "{gone} in {md}");
        }
        let text = html_to(html, Flavor::Text, Some(&base)).expect("converts");
        assert!(
            text.contains("Café du Monde\n\nFresh beignets and coffee.\nOpen daily."),
            "{text}"
        );
        assert!(
            !text.contains("**") && !text.contains("](") && !text.contains("alert"),
            "{text}"
        );
    }
}
