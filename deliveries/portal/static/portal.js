// The portal's only script (no inline code: the Content-Security-Policy allows this file
// alone). Two jobs: the entry page posts the link's token, which is in the URL fragment
// and so never reaches a server log, and a delivery's page refreshes its status until
// the delivery is finished. Everything works without it but these two conveniences.
(function () {
  "use strict";

  function enter() {
    var form = document.getElementById("enter-form");
    var field = document.getElementById("id_token");
    if (!form || !field) return;
    var token = window.location.hash.slice(1);
    if (!token) {
      var status = document.getElementById("enter-status");
      if (status) status.textContent = "Paste the access code from your link below.";
      return;
    }
    // Off the address bar and the history before anything else.
    history.replaceState(null, "", window.location.pathname);
    field.value = decodeURIComponent(token);
    form.submit();
  }

  function followDelivery() {
    var live = document.getElementById("delivery-live");
    if (!live || live.dataset.terminal === "true") return;
    var rounds = 0;
    function refresh() {
      rounds += 1;
      fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (response) { return response.ok ? response.text() : null; })
        .then(function (text) {
          if (!text) return;
          var page = new DOMParser().parseFromString(text, "text/html");
          var fresh = page.getElementById("delivery-live");
          if (!fresh) return;
          live.innerHTML = fresh.innerHTML;
          live.dataset.terminal = fresh.dataset.terminal;
          if (fresh.dataset.terminal !== "true" && rounds < 150) window.setTimeout(refresh, 2000);
        });
    }
    window.setTimeout(refresh, 2000);
  }

  document.addEventListener("DOMContentLoaded", function () {
    enter();
    followDelivery();
  });
})();
