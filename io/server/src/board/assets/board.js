// The Board's live updates, without reloading the page: listen to /board/events; when a todo
// the page shows (on the overview and queue pages, any todo) changes, fetch the page's <main>
// again (the server answers it alone for `X-Relay-Fragment: main`) and replace only the parts
// that changed. A part the operator is using is left alone until they are done with it: one
// that holds the focused field or text they typed, or any part while a pointer is pressed (a
// replaced button would swallow the click). Served from the binary; no inline script anywhere
// (the CSP forbids it).
(function () {
  "use strict";
  if (!window.EventSource || !window.fetch || location.pathname === "/board/login") { return; }
  var main = document.querySelector("main");
  if (!main) { return; }
  var onTodoPage = location.pathname.indexOf("/board/todos/") === 0;
  var shown = {};
  function remember() {
    shown = {};
    document.querySelectorAll("[data-todo]").forEach(function (el) { shown[el.getAttribute("data-todo")] = true; });
  }
  remember();
  var pointerDown = false, leaving = false, fetching = false, again = false, held = null;
  var patches = 0;

  // Whether a part of the page is in use: it holds the focus, or a field edited by hand.
  function inUse(el) {
    if (el.contains(document.activeElement) && document.activeElement !== document.body) { return true; }
    var fields = el.querySelectorAll ? el.querySelectorAll("input, textarea, select") : [];
    for (var i = 0; i < fields.length; i++) {
      var f = fields[i];
      if (f.type === "hidden") { continue; }
      if (f.tagName === "SELECT") {
        for (var j = 0; j < f.options.length; j++) {
          if (f.options[j].selected !== f.options[j].defaultSelected) { return true; }
        }
      } else if (f.type === "checkbox" || f.type === "radio") {
        if (f.checked !== f.defaultChecked) { return true; }
      } else if (f.value !== f.defaultValue) { return true; }
    }
    return false;
  }

  function signature(el) {
    return el.nodeType === 1 ? el.tagName + "." + el.className + "#" + (el.id || el.getAttribute("data-key") || "") : "#" + el.nodeType;
  }

  // Replaces the children of <main> that differ, in place; a part in use is kept (and the
  // patch is tried again once it is free).
  function patch(html) {
    var t = document.createElement("template");
    t.innerHTML = html;
    var fresh = Array.prototype.slice.call(t.content.childNodes);
    var old = Array.prototype.slice.call(main.childNodes);
    var kept = false;
    for (var i = 0; i < fresh.length; i++) {
      var o = old[i], n = fresh[i];
      if (!o) { main.appendChild(n); continue; }
      if (o.nodeType === 1 && n.nodeType === 1 && o.outerHTML === n.outerHTML) { continue; }
      if (o.nodeType === 3 && n.nodeType === 3 && o.nodeValue === n.nodeValue) { continue; }
      if (o.nodeType === 1 && inUse(o) && signature(o) === signature(n)) { kept = true; continue; }
      main.replaceChild(n, o);
    }
    for (var k = fresh.length; k < old.length; k++) {
      if (old[k].nodeType === 1 && inUse(old[k])) { kept = true; continue; }
      main.removeChild(old[k]);
    }
    remember();
    patches += 1;
    // Tests read it; it counts patches, and it survives only while the page is never reloaded.
    document.body.setAttribute("data-patches", String(patches));
    return kept;
  }

  function refresh() {
    if (leaving) { return; }
    if (pointerDown) { held = refresh; return; }
    if (fetching) { again = true; return; }
    fetching = true;
    fetch(location.href, { headers: { "X-Relay-Fragment": "main" }, credentials: "same-origin", cache: "no-store" })
      .then(function (res) {
        // A session that ended answers the login page instead: show it.
        if (res.redirected || res.headers.get("X-Relay-Fragment") !== "main") { leaving = true; location.reload(); return null; }
        return res.text();
      })
      .then(function (html) {
        fetching = false;
        if (html === null || leaving) { return; }
        if (pointerDown) { held = refresh; return; }
        var kept = patch(html);
        if (again || kept) { again = false; if (kept) { held = refresh; } else { refresh(); } }
      })
      .catch(function () { fetching = false; });
  }

  // A part kept for the operator is brought up to date once they are done with it.
  function release() { if (held && !pointerDown) { var f = held; held = null; setTimeout(f, 0); } }
  document.addEventListener("pointerdown", function () { pointerDown = true; }, true);
  document.addEventListener("pointerup", function () { pointerDown = false; setTimeout(release, 0); }, true);
  document.addEventListener("pointercancel", function () { pointerDown = false; release(); }, true);
  document.addEventListener("focusout", function () { setTimeout(release, 0); }, true);
  document.addEventListener("submit", function () { leaving = true; }, true);

  var es = new EventSource("/board/events");
  // Says on the page that it is live (the browser test waits for it before it changes a todo).
  // On (re)connecting, catch up with whatever changed while no stream was open: between the
  // page's render and this moment, or while the server was away.
  es.addEventListener("open", function () {
    document.body.setAttribute("data-live", "on");
    refresh();
  });
  es.addEventListener("error", function () { document.body.setAttribute("data-live", "off"); });
  es.addEventListener("todo", function (ev) {
    var id = JSON.parse(ev.data).id;
    // A null id: the stream fell behind, so anything may have changed.
    if (onTodoPage && id !== null && !shown[id]) { return; }
    refresh();
  });
}());
