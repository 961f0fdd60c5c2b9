// The chat playground: a multi-turn conversation streamed from /v1/chat/completions (SSE).
(function () {
  "use strict";
  var $ = function (id) { return document.getElementById(id); };
  var messagesEl = $("messages"), input = $("input"), sendBtn = $("send"), stopBtn = $("stop");
  var history = []; // [{role, content}] of finished turns
  var controller = null; // the running answer's AbortController

  function addMessage(role, text) {
    var div = document.createElement("div");
    div.className = "msg " + role;
    if (role === "user" || role === "error") div.textContent = text;
    var content = document.createElement("div");
    content.className = "content";
    if (role === "assistant") div.appendChild(content);
    messagesEl.appendChild(div);
    messagesEl.scrollTop = messagesEl.scrollHeight;
    return div;
  }

  function showError(message) {
    var div = addMessage("error", message);
    div.setAttribute("role", "alert");
    return div;
  }

  async function loadModels() {
    try {
      var resp = await fetch("/v1/models");
      var body = await resp.json();
      var select = $("model");
      select.innerHTML = "";
      (body.data || []).forEach(function (m) {
        var opt = document.createElement("option");
        opt.value = m.id;
        opt.textContent = m.id + (m.max_model_len ? " (" + m.max_model_len + " tokens)" : "");
        select.appendChild(opt);
      });
    } catch (e) {
      showError("could not list the models: " + e);
    }
  }

  function number(id, fallback) {
    var v = parseFloat($(id).value);
    return isNaN(v) ? fallback : v;
  }

  function setBusy(busy) {
    sendBtn.disabled = busy;
    stopBtn.disabled = !busy;
  }

  function errorMessage(body, status) {
    if (body && body.error && body.error.message) return body.error.message;
    return "the server answered " + status;
  }

  async function send() {
    var text = input.value;
    if (!text.trim() || controller) return;
    input.value = "";
    addMessage("user", text);
    var messages = [];
    var system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages = messages.concat(history, [{ role: "user", content: text }]);
    var body = {
      model: $("model").value,
      messages: messages,
      temperature: number("temperature", 0.7),
      top_p: number("top_p", 1),
      max_tokens: Math.max(1, Math.round(number("max_tokens", 256))),
      stream: true,
      stream_options: { include_usage: true },
    };
    controller = new AbortController();
    setBusy(true);
    var msg = addMessage("assistant", "");
    var contentEl = msg.querySelector(".content");
    var meta = document.createElement("div");
    meta.className = "meta";
    msg.appendChild(meta);
    var answer = "", tokens = 0, finish = null, usage = null, failed = null;
    var t0 = performance.now(), tFirst = null, tLast = null, pending = false;
    function paint() {
      pending = false;
      contentEl.innerHTML = window.inflightMarkdown.render(answer);
      messagesEl.scrollTop = messagesEl.scrollHeight;
    }
    try {
      var resp = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!resp.ok) {
        var errBody = null;
        try { errBody = await resp.json(); } catch (e) { /* not JSON */ }
        failed = errorMessage(errBody, resp.status);
      } else {
        var reader = resp.body.getReader(), decoder = new TextDecoder(), buffer = "";
        outer: for (;;) {
          var chunk = await reader.read();
          if (chunk.done) break;
          buffer += decoder.decode(chunk.value, { stream: true });
          var events = buffer.split("\n\n");
          buffer = events.pop();
          for (var i = 0; i < events.length; i++) {
            var line = events[i].trim();
            if (!line.startsWith("data:")) continue;
            var data = line.slice(5).trim();
            if (data === "[DONE]") break outer;
            var obj = JSON.parse(data);
            if (obj.error) { failed = obj.error.message || "the stream failed"; break outer; }
            if (obj.usage) usage = obj.usage;
            (obj.choices || []).forEach(function (c) {
              var delta = (c.delta && c.delta.content) || "";
              if (delta) {
                if (tFirst === null) tFirst = performance.now();
                tLast = performance.now();
                answer += delta;
                tokens += 1;
                if (!pending) { pending = true; requestAnimationFrame(paint); }
              }
              if (c.finish_reason) finish = c.finish_reason;
            });
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else failed = String(e);
    }
    paint();
    if (failed !== null) {
      msg.classList.add("failed");
      showError(failed);
    }
    var n = usage ? usage.completion_tokens : tokens;
    var parts = [];
    if (tFirst !== null) parts.push("first token " + Math.round(tFirst - t0) + " ms");
    if (tFirst !== null && tLast > tFirst && n > 1) parts.push(((n - 1) / ((tLast - tFirst) / 1000)).toFixed(1) + " tok/s");
    parts.push(n + " tokens");
    parts.push("finish: " + (finish || (failed !== null ? "error" : "?")));
    meta.textContent = parts.join(" · ");
    meta.dataset.finish = finish || (failed !== null ? "error" : "");
    if (failed === null && answer) history.push({ role: "user", content: text }, { role: "assistant", content: answer });
    controller = null;
    setBusy(false);
    input.focus();
  }

  function stop() {
    if (controller) controller.abort();
  }

  input.addEventListener("keydown", function (e) {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    } else if (e.key === "Escape") {
      stop();
    }
  });
  document.addEventListener("keydown", function (e) { if (e.key === "Escape") stop(); });
  sendBtn.addEventListener("click", send);
  stopBtn.addEventListener("click", stop);
  $("clear").addEventListener("click", function () {
    stop();
    history = [];
    messagesEl.innerHTML = "";
    input.focus();
  });
  loadModels();
  input.focus();
})();
