// The Board's live updates: listen to /board/events and reload the page when a todo it shows
// (or, on the overview and queue pages, any todo) changes. Served from the binary; no inline
// script anywhere (the CSP forbids it).
(function () {
  "use strict";
  if (!window.EventSource || location.pathname === "/board/login") { return; }
  var shown = {};
  document.querySelectorAll("[data-todo]").forEach(function (el) { shown[el.getAttribute("data-todo")] = true; });
  var onTodoPage = location.pathname.indexOf("/board/todos/") === 0;
  var busy = false;
  var es = new EventSource("/board/events");
  // Says on the page that it is live (the browser test waits for it before it changes a todo).
  es.addEventListener("open", function () { document.body.setAttribute("data-live", "on"); });
  es.addEventListener("error", function () { document.body.setAttribute("data-live", "off"); });
  es.addEventListener("todo", function (ev) {
    if (busy) { return; }
    var id = JSON.parse(ev.data).id;
    // A null id: the stream fell behind, so anything may have changed.
    if (onTodoPage && id !== null && !shown[id]) { return; }
    // Do not throw away what the operator is typing.
    var a = document.activeElement;
    if (a && (a.tagName === "INPUT" || a.tagName === "SELECT") && a.value) { return; }
    busy = true;
    location.reload();
  });
}());
