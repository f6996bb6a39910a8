// The approvals console's only script (served from /ui/static/console.js; the
// Content-Security-Policy allows no other). It keeps the pending approvals live and
// the ages current; every page works without it. It never builds HTML from strings:
// the live list arrives as HTML the server rendered (and escaped), which is parsed by
// DOMParser into an inert document (its scripts never run) and moved in node by node;
// everything it writes itself goes through textContent.
'use strict';

(function () {
  function duration(ms) {
    var s = Math.max(0, Math.round(ms / 1000));
    if (s < 60) return s + ' s';
    var m = Math.round(s / 60);
    if (m < 60) return m + ' min';
    var h = Math.floor(m / 60);
    return h + ' h ' + (m % 60) + ' min';
  }

  // Ages and expiries, from the data attributes the server set.
  function tick() {
    var now = Date.now();
    document.querySelectorAll('[data-created-ms]').forEach(function (item) {
      var created = Number(item.getAttribute('data-created-ms'));
      var expires = Number(item.getAttribute('data-expires-ms'));
      var age = item.querySelector('[data-age]');
      if (age) age.textContent = duration(now - created) + ' ago';
      var expiry = item.querySelector('[data-expiry]');
      if (expiry) {
        expiry.textContent = expires > now ? 'in ' + duration(expires - now) : 'expired';
      }
    });
  }

  // Replaces the list's items with the server's: new ones are added, decided ones
  // removed, changed ones (another approver joined) replaced; an unchanged item stays
  // as it is, with any reason being typed into it.
  function merge(list, html) {
    var doc = new DOMParser().parseFromString(html, 'text/html');
    var fresh = doc.getElementById('pending-list');
    if (!fresh) return;
    var incoming = Array.prototype.slice.call(fresh.querySelectorAll('[data-approval-id]'));
    var wanted = {};
    incoming.forEach(function (el) { wanted[el.getAttribute('data-approval-id')] = true; });
    var current = {};
    Array.prototype.slice.call(list.querySelectorAll('[data-approval-id]')).forEach(function (el) {
      var id = el.getAttribute('data-approval-id');
      if (wanted[id]) {
        current[id] = el;
      } else {
        el.remove();
      }
    });
    var previous = document.getElementById('pending-empty');
    incoming.forEach(function (el) {
      var id = el.getAttribute('data-approval-id');
      var have = current[id];
      var node = have;
      if (!have) {
        node = document.importNode(el, true);
      } else if (have.getAttribute('data-version') !== el.getAttribute('data-version')) {
        node = document.importNode(el, true);
        var typed = have.querySelector('[name="reason"]');
        var field = node.querySelector('[name="reason"]');
        if (typed && field) field.value = typed.value;
        have.replaceWith(node);
      }
      // Moved only when out of place: moving an item would take the focus from its
      // reason field.
      if (previous.nextElementSibling !== node) previous.after(node);
      previous = node;
    });
    var empty = document.getElementById('pending-empty');
    if (empty) empty.hidden = incoming.length > 0;
    var more = document.getElementById('pending-more');
    var moreFresh = doc.getElementById('pending-more');
    var hasMore = !!moreFresh && !moreFresh.hidden;
    if (more) more.hidden = !hasMore;
    var count = document.getElementById('pending-count');
    if (count) count.textContent = String(incoming.length) + (hasMore ? '+' : '');
    tick();
  }

  function live() {
    var list = document.getElementById('pending-list');
    var state = document.getElementById('live-state');
    if (!list || !window.EventSource) return;
    // Same origin: the HttpOnly session cookie authenticates it; no token in the URL.
    var source = new EventSource('/ui/events');
    source.addEventListener('pending', function (event) {
      merge(list, event.data);
      if (state) state.textContent = 'Updates live.';
    });
    source.addEventListener('signed_out', function () {
      source.close();
      window.location.assign('/ui');
    });
    source.addEventListener('error', function () {
      if (!state) return;
      // EventSource retries a dropped stream itself, but not a refused one.
      state.textContent = source.readyState === EventSource.CLOSED
        ? 'Live updates stopped; reload the page.'
        : 'Connection lost; reconnecting…';
    });
  }

  // A call page reloads until its call has a result.
  function follow() {
    var call = document.querySelector('[data-call-final="false"]');
    if (call) window.setTimeout(function () { window.location.reload(); }, 1500);
  }

  document.addEventListener('DOMContentLoaded', function () {
    tick();
    window.setInterval(tick, 1000);
    live();
    follow();
  });
})();
