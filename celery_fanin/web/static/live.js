// celery-fanin dashboard: live updates by polling. The page works without this script; with it, the element
// #live is replaced every few seconds by the same URL's `?partial=1` rendering, until the server answers
// `X-Fanin-Final: 1` (nothing on the page will change any more). Polling pauses while the tab is hidden.
(function () {
  "use strict";
  var region = document.getElementById("live");
  var status = document.getElementById("live-status");
  if (!region) { return; }
  var interval = Math.max(200, 1000 * parseFloat(region.getAttribute("data-interval") || "2"));
  var timer = null;
  var busy = false;
  var stopped = false;

  function show(text, kind) {
    if (status) { status.textContent = text; status.className = "live-status " + kind; }
  }
  function schedule() {
    if (!stopped) { timer = window.setTimeout(tick, interval); }
  }
  function stop() {
    stopped = true;
    region.setAttribute("data-final", "");
    show("final: nothing here will change", "final");
  }
  function partialUrl() {
    var url = new URL(window.location.href);
    url.searchParams.set("partial", "1");
    return url.toString();
  }
  function tick() {
    if (stopped) { return; }
    if (document.hidden || busy) { schedule(); return; }
    busy = true;
    fetch(partialUrl(), { credentials: "same-origin", cache: "no-store", headers: { "Accept": "text/html" } })
      .then(function (response) {
        if (!response.ok) {
          return response.text().then(function (body) { throw new Error(body || ("HTTP " + response.status)); });
        }
        return response.text().then(function (body) {
          region.innerHTML = body;
          region.setAttribute("data-updated", String(Date.now()));
          if (response.headers.get("X-Fanin-Final") === "1") { stop(); return; }
          show("live · updated " + new Date().toLocaleTimeString(), "ok");
        });
      })
      .catch(function (error) { show("not updated: " + error.message, "error"); })
      .then(function () { busy = false; schedule(); });
  }

  if (region.hasAttribute("data-final")) { stop(); return; }
  show("live", "ok");
  schedule();
  document.addEventListener("visibilitychange", function () {
    if (!document.hidden && !stopped && !busy) { window.clearTimeout(timer); tick(); }
  });
})();
