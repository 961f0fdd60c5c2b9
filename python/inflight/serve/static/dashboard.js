// The engine dashboard: numbers and plots from the SSE feed /v1/engine/stats (a few updates a second).
(function () {
  "use strict";
  var $ = function (id) { return document.getElementById(id); };
  var HISTORY = 240; // samples kept (~1 minute)
  var samples = []; // {t, used, total, hit, rate, running}
  var css = getComputedStyle(document.documentElement);
  var color = function (name) { return css.getPropertyValue(name).trim(); };

  function setText(id, value) { var el = $(id); if (el) el.textContent = value; }

  function canvas(id) {
    var c = $(id), dpr = window.devicePixelRatio || 1;
    var w = c.clientWidth, h = c.clientHeight;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    var g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    g.font = "11px system-ui, sans-serif";
    return { g: g, w: w, h: h };
  }

  function axes(p, left, bottom, maxY, label) {
    var g = p.g;
    g.strokeStyle = color("--line");
    g.fillStyle = color("--muted");
    g.beginPath();
    g.moveTo(left, 6);
    g.lineTo(left, p.h - bottom);
    g.lineTo(p.w - 6, p.h - bottom);
    g.stroke();
    g.fillText(String(maxY), 2, 14);
    g.fillText("0", 2, p.h - bottom);
    if (label) g.fillText(label, left + 4, 14);
  }

  function drawSteps(snap) {
    var p = canvas("steps"), g = p.g, left = 44, bottom = 16;
    var steps = snap.steps.slice(-80);
    var top = 1;
    steps.forEach(function (s) { top = Math.max(top, s.context_tokens + s.decode_tokens); });
    var budget = snap.token_budget, maxY = top;
    if (budget <= 2 * top) maxY = budget;
    maxY = Math.max(1, Math.ceil(maxY * 1.1));
    axes(p, left, bottom, maxY, "tokens");
    var plotH = p.h - bottom - 6, bw = (p.w - left - 8) / Math.max(steps.length, 1);
    steps.forEach(function (s, i) {
      var x = left + 1 + i * bw, hc = (s.context_tokens / maxY) * plotH, hd = (s.decode_tokens / maxY) * plotH;
      g.fillStyle = color("--dec");
      g.fillRect(x, p.h - bottom - hd, Math.max(bw - 1, 1), hd);
      g.fillStyle = color("--ctx");
      g.fillRect(x, p.h - bottom - hd - hc, Math.max(bw - 1, 1), hc);
    });
    if (budget <= maxY) {
      var y = p.h - bottom - (budget / maxY) * plotH;
      g.setLineDash([5, 4]);
      g.strokeStyle = color("--err");
      g.beginPath(); g.moveTo(left, y); g.lineTo(p.w - 6, y); g.stroke();
      g.setLineDash([]);
      setText("budget-note", "dashed: token budget " + budget);
    } else {
      setText("budget-note", "token budget " + budget + " (above the scale)");
    }
  }

  function line(p, left, bottom, values, maxY, stroke) {
    var g = p.g, plotH = p.h - bottom - 6, n = values.length;
    if (n < 2) return;
    g.strokeStyle = stroke;
    g.lineWidth = 1.5;
    g.beginPath();
    values.forEach(function (v, i) {
      var x = left + (i / (Math.max(n, 60) - 1)) * (p.w - left - 8); // fills up, then scrolls
      var y = p.h - bottom - (Math.min(v, maxY) / maxY) * plotH;
      if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
    });
    g.stroke();
    g.lineWidth = 1;
  }

  function drawKv() {
    var p = canvas("kv"), left = 44, bottom = 16;
    var total = samples.length ? samples[samples.length - 1].total : 1;
    axes(p, left, bottom, total, "blocks");
    line(p, left, bottom, samples.map(function (s) { return s.used; }), Math.max(total, 1), color("--dec"));
    line(p, left, bottom, samples.map(function (s) { return s.reusable; }), Math.max(total, 1), color("--ctx"));
    line(p, left, bottom, samples.map(function (s) { return s.hit * total; }), Math.max(total, 1), color("--ok"));
  }

  function drawRate() {
    var p = canvas("rate"), left = 44, bottom = 16, maxR = 1, maxRun = 1;
    samples.forEach(function (s) { maxR = Math.max(maxR, s.rate); maxRun = Math.max(maxRun, s.running); });
    maxR = Math.ceil(maxR * 1.15);
    axes(p, left, bottom, maxR, "tok/s");
    line(p, left, bottom, samples.map(function (s) { return s.rate; }), maxR, color("--accent"));
    line(p, left, bottom, samples.map(function (s) { return (s.running / maxRun) * maxR; }), maxR, color("--ctx"));
    p.g.fillStyle = color("--muted");
    p.g.fillText("running max " + maxRun, p.w - 110, 14);
  }

  function drawTimeline(snap) {
    var p = canvas("timeline"), g = p.g, left = 64, right = 8, top = 8, bottom = 18;
    var reqs = snap.requests;
    var span = 10;
    reqs.forEach(function (r) { if (r.queued_ago !== null) span = Math.max(span, r.queued_ago); });
    span = Math.min(Math.ceil(span), 120);
    var x = function (ago) { return left + (1 - Math.min(ago, span) / span) * (p.w - left - right); };
    var rowH = Math.max(4, Math.min(18, (p.h - top - bottom) / Math.max(reqs.length, 1)));
    g.fillStyle = color("--muted");
    g.fillText(span + " s ago", left, p.h - 4);
    g.fillText("now", p.w - right - 22, p.h - 4);
    reqs.forEach(function (r, i) {
      var y = top + i * rowH, h = Math.max(rowH - 3, 2);
      var end = r.finished_ago === null ? 0 : r.finished_ago;
      var firstChunk = r.chunks_ago.length ? r.chunks_ago[0][0] : null;
      var prefillEnd = r.first_token_ago !== null ? r.first_token_ago : end;
      g.fillStyle = "#b8bec9";
      g.fillRect(x(r.queued_ago), y, Math.max(x(firstChunk !== null ? firstChunk : end) - x(r.queued_ago), 1), h);
      if (firstChunk !== null) {
        g.fillStyle = color("--ctx");
        g.fillRect(x(firstChunk), y, Math.max(x(prefillEnd) - x(firstChunk), 1), h);
        g.fillStyle = "#7a4a10";
        r.chunks_ago.forEach(function (c) { g.fillRect(x(c[0]), y, 1, h); });
      }
      if (r.first_token_ago !== null) {
        g.fillStyle = color("--dec");
        g.fillRect(x(r.first_token_ago), y, Math.max(x(end) - x(r.first_token_ago), 1), h);
      }
      if (r.finished_ago !== null) {
        var bad = r.finish_reason === "error" || r.finish_reason === "cancelled";
        g.fillStyle = bad ? color("--err") : color("--ok");
        g.fillRect(x(end) - 3, y, 3, h);
      }
      if (rowH >= 10) {
        g.fillStyle = color("--muted");
        g.fillText("#" + r.id, 4, y + h - 1);
      }
    });
  }

  function update(snap) {
    setText("model", snap.model);
    setText("parallel", snap.parallel);
    var status = $("status");
    status.textContent = snap.alive ? "" : "engine not running";
    status.className = snap.alive ? "" : "status-dead";
    setText("running", snap.running);
    setText("waiting", snap.waiting);
    setText("paused", snap.paused);
    setText("in-flight", snap.in_flight);
    setText("kv-used", snap.kv.used);
    setText("kv-total", snap.kv.total);
    setText("kv-free", snap.kv.free);
    setText("kv-reusable", snap.kv.reusable);
    setText("hit-rate", (100 * snap.kv.hit_rate).toFixed(1) + "%");
    setText("reused", snap.kv.reused_blocks);
    setText("tok-s", snap.tokens_per_s.toFixed(1));
    setText("generated", snap.generated_tokens);
    setText("preemptions", snap.preemptions);
    setText("iter", snap.iter);
    setText("budget", snap.token_budget);
    var mapping = /tp=(\d+) pp=(\d+)/.exec(snap.parallel || "") || [null, "1", "1"];
    setText("ranks", String(Number(mapping[1]) * Number(mapping[2])));
    var lastStep = snap.steps.length ? snap.steps[snap.steps.length - 1] : null;
    setText("micro", lastStep ? lastStep.micro_batches : 0);
    samples.push({ used: snap.kv.used, reusable: snap.kv.reusable, total: snap.kv.total, hit: snap.kv.hit_rate, rate: snap.tokens_per_s, running: snap.running });
    if (samples.length > HISTORY) samples.shift();
    drawSteps(snap);
    drawKv();
    drawRate();
    drawTimeline(snap);
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  }

  var source = new EventSource("/v1/engine/stats");
  source.onmessage = function (e) { update(JSON.parse(e.data)); };
  source.onerror = function () {
    var status = $("status");
    status.textContent = "feed lost; reconnecting";
    status.className = "status-dead";
  };
  window.inflightDashboard = { update: update };
})();
