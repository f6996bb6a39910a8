//! The page parsed with its depth bounded while it is parsed.
//!
//! html5ever's tree builder walks its stack of open elements for most start tags, so a
//! page's cost grows with its length times its nesting depth: a few MiB of unclosed
//! `<div>`s keep a thread busy for minutes. No guess made before parsing can know that
//! depth (the tree builder reopens formatting elements, closes some implicitly, treats
//! SVG and MathML apart); the tree builder itself does. So the page is fed to it in
//! small chunks through a sink that measures, in the tree as it stands, the depth of
//! every node it inserts (walking up its ancestors, at most the limit and one more:
//! nodes the parser moves — the adoption agency's reparenting, which happens under
//! elements not yet in the tree — are measured where they are when something is inserted
//! under them), and parsing stops at the end of the chunk in which the tree first grew
//! deeper than the limit. A chunk adds at most a chunk's worth of elements, so the stack the parser ever
//! walks is at most the limit plus one chunk: the work stays linear in the page's length.

use std::borrow::Cow;
use std::cell::Cell;
use std::rc::Rc;

use ego_tree::NodeId;
use html5ever::tendril::{StrTendril, TendrilSink as _};
use html5ever::tree_builder::{ElementFlags, NodeOrText, QuirksMode, TreeSink};
use html5ever::{Attribute, QualName};
use scraper::{Html, HtmlTreeSink};

/// Bytes fed to the parser at once.
const CHUNK_BYTES: usize = 4096;

/// `html` parsed, or `None` when its elements nest deeper than `limit`.
pub(super) fn parse_within_depth(html: &str, limit: usize) -> Option<Html> {
    let deepest = Rc::new(Cell::new(0usize));
    let sink = DepthSink {
        inner: HtmlTreeSink::new(Html::new_document()),
        limit,
        deepest: Rc::clone(&deepest),
    };
    let mut parser = html5ever::parse_document(sink, Default::default());
    let mut rest = html;
    while !rest.is_empty() {
        let mut cut = rest.len().min(CHUNK_BYTES);
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        let (chunk, after) = rest.split_at(cut);
        parser.process(StrTendril::from_slice(chunk));
        if deepest.get() > limit {
            return None;
        }
        rest = after;
    }
    let parsed = parser.finish();
    (deepest.get() <= limit).then_some(parsed)
}

/// scraper's sink, and the deepest a node was found when it was inserted.
struct DepthSink {
    inner: HtmlTreeSink,
    limit: usize,
    deepest: Rc<Cell<usize>>,
}

impl DepthSink {
    /// Measures `child` where it now is in the tree: its ancestors, counted up to one
    /// past the limit (the walk is bounded; a deeper node stops the parse anyway).
    fn inserted(&self, node: Option<NodeId>) {
        let Some(node) = node else {
            return;
        };
        let html = self.inner.0.borrow();
        let depth = html
            .tree
            .get(node)
            .map_or(0, |n| n.ancestors().take(self.limit + 1).count());
        if depth > self.deepest.get() {
            self.deepest.set(depth);
        }
    }
}

impl TreeSink for DepthSink {
    type Output = Html;
    type Handle = NodeId;
    type ElemName<'a> = <HtmlTreeSink as TreeSink>::ElemName<'a>;

    fn finish(self) -> Html {
        self.inner.finish()
    }

    fn parse_error(&self, msg: Cow<'static, str>) {
        self.inner.parse_error(msg);
    }

    fn get_document(&self) -> NodeId {
        self.inner.get_document()
    }

    fn elem_name<'a>(&'a self, target: &'a NodeId) -> Self::ElemName<'a> {
        self.inner.elem_name(target)
    }

    fn create_element(&self, name: QualName, attrs: Vec<Attribute>, flags: ElementFlags) -> NodeId {
        self.inner.create_element(name, attrs, flags)
    }

    fn create_comment(&self, text: StrTendril) -> NodeId {
        self.inner.create_comment(text)
    }

    fn create_pi(&self, target: StrTendril, data: StrTendril) -> NodeId {
        self.inner.create_pi(target, data)
    }

    fn append(&self, parent: &NodeId, child: NodeOrText<NodeId>) {
        let measured = node_of(&child);
        self.inner.append(parent, child);
        self.inserted(measured);
    }

    fn append_based_on_parent_node(
        &self,
        element: &NodeId,
        prev_element: &NodeId,
        child: NodeOrText<NodeId>,
    ) {
        let measured = node_of(&child);
        self.inner
            .append_based_on_parent_node(element, prev_element, child);
        self.inserted(measured);
    }

    fn append_doctype_to_document(
        &self,
        name: StrTendril,
        public_id: StrTendril,
        system_id: StrTendril,
    ) {
        self.inner
            .append_doctype_to_document(name, public_id, system_id);
    }

    fn mark_script_already_started(&self, node: &NodeId) {
        self.inner.mark_script_already_started(node);
    }

    fn pop(&self, node: &NodeId) {
        self.inner.pop(node);
    }

    fn get_template_contents(&self, target: &NodeId) -> NodeId {
        self.inner.get_template_contents(target)
    }

    fn same_node(&self, x: &NodeId, y: &NodeId) -> bool {
        self.inner.same_node(x, y)
    }

    fn set_quirks_mode(&self, mode: QuirksMode) {
        self.inner.set_quirks_mode(mode);
    }

    fn append_before_sibling(&self, sibling: &NodeId, new_node: NodeOrText<NodeId>) {
        let measured = node_of(&new_node);
        self.inner.append_before_sibling(sibling, new_node);
        self.inserted(measured);
    }

    fn add_attrs_if_missing(&self, target: &NodeId, attrs: Vec<Attribute>) {
        self.inner.add_attrs_if_missing(target, attrs);
    }

    fn associate_with_form(
        &self,
        target: &NodeId,
        form: &NodeId,
        nodes: (&NodeId, Option<&NodeId>),
    ) {
        self.inner.associate_with_form(target, form, nodes);
    }

    fn remove_from_parent(&self, target: &NodeId) {
        self.inner.remove_from_parent(target);
    }

    /// Measured where they land only once something is inserted under them: the new
    /// parent is often not in the tree yet (the adoption agency attaches it after).
    fn reparent_children(&self, node: &NodeId, new_parent: &NodeId) {
        self.inner.reparent_children(node, new_parent);
    }

    fn is_mathml_annotation_xml_integration_point(&self, handle: &NodeId) -> bool {
        self.inner
            .is_mathml_annotation_xml_integration_point(handle)
    }

    fn set_current_line(&self, line_number: u64) {
        self.inner.set_current_line(line_number);
    }
}

/// The node `child` inserts, if it is one (text adds no level the parser walks).
fn node_of(child: &NodeOrText<NodeId>) -> Option<NodeId> {
    match child {
        NodeOrText::AppendNode(node) => Some(*node),
        NodeOrText::AppendText(_) => None,
    }
}
