// A small Markdown renderer for model output that can never inject HTML: the text is escaped first,
// and only then are the few constructs turned into tags (code fences, inline code, bold, italic,
// headings, lists, paragraphs). Nothing from the model reaches innerHTML unescaped.
(function () {
  "use strict";

  function escapeHtml(s) {
    return String(s)
      .replace(/&/g, "&amp;")
      .replace(/</g, "&lt;")
      .replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;")
      .replace(/'/g, "&#39;");
  }

  // `s` is already escaped.
  function inline(s) {
    return s
      .split(/(`[^`\n]+`)/g)
      .map(function (part) {
        if (part.length > 1 && part[0] === "`" && part[part.length - 1] === "`") {
          return "<code>" + part.slice(1, -1) + "</code>";
        }
        return part
          .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
          .replace(/(^|[^*\w])\*([^*\s][^*\n]*?)\*(?![*\w])/g, "$1<em>$2</em>");
      })
      .join("");
  }

  function render(text) {
    var lines = String(text).split("\n");
    var out = [];
    var para = [];
    var list = null; // {tag, items}
    function flushPara() {
      if (para.length) out.push("<p>" + para.map(function (l) { return inline(escapeHtml(l)); }).join("<br>") + "</p>");
      para = [];
    }
    function flushList() {
      if (list) {
        out.push("<" + list.tag + ">" + list.items.map(function (t) { return "<li>" + inline(escapeHtml(t)) + "</li>"; }).join("") + "</" + list.tag + ">");
      }
      list = null;
    }
    for (var i = 0; i < lines.length; i++) {
      var line = lines[i];
      var fence = /^\s*```\s*([\w+#.-]*)\s*$/.exec(line);
      if (fence) {
        flushPara();
        flushList();
        var code = [];
        for (i = i + 1; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
        out.push('<pre><code data-lang="' + escapeHtml(fence[1]) + '">' + escapeHtml(code.join("\n")) + "</code></pre>");
        continue;
      }
      var heading = /^(#{1,6})\s+(.*)$/.exec(line);
      if (heading) {
        flushPara();
        flushList();
        var level = Math.min(heading[1].length + 2, 6); // inside a message: h3 and smaller
        out.push("<h" + level + ">" + inline(escapeHtml(heading[2])) + "</h" + level + ">");
        continue;
      }
      var item = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line);
      if (item) {
        flushPara();
        var tag = /\d/.test(item[1]) ? "ol" : "ul";
        if (list && list.tag !== tag) flushList();
        if (!list) list = { tag: tag, items: [] };
        list.items.push(item[2]);
        continue;
      }
      if (/^\s*$/.test(line)) {
        flushPara();
        flushList();
        continue;
      }
      flushList();
      para.push(line);
    }
    flushPara();
    flushList();
    return out.join("");
  }

  window.inflightMarkdown = { render: render, escapeHtml: escapeHtml };
})();
