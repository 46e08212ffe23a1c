// A small Markdown renderer for replies: fenced and indented code blocks, headings, lists, quotes,
// paragraphs, inline code, bold, italic and http(s) links. It builds DOM nodes (never HTML from
// the text), so nothing a model writes can become markup or script.
"use strict";
const Markdown = (() => {
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|\*([^\s*](?:[^*]*?[^\s*])?)\*|(?<![A-Za-z0-9])_([^\s_](?:[^_]*?[^\s_])?)_(?![A-Za-z0-9])|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g;

  function inline(text, parent) {
    let last = 0;
    const re = new RegExp(INLINE.source, "g"); // its own lastIndex: bold and italic recurse
    for (let m; (m = re.exec(text)) !== null;) {
      if (m.index > last) appendText(parent, text.slice(last, m.index));
      if (m[1] !== undefined) {
        const code = document.createElement("code");
        code.textContent = m[2].replace(/^ (.*) $/s, "$1");
        parent.append(code);
      } else if (m[3] !== undefined || m[4] !== undefined) {
        const b = document.createElement("strong");
        inline(m[3] !== undefined ? m[3] : m[4], b);
        parent.append(b);
      } else if (m[5] !== undefined || m[6] !== undefined) {
        const i = document.createElement("em");
        inline(m[5] !== undefined ? m[5] : m[6], i);
        parent.append(i);
      } else {
        const a = document.createElement("a");
        a.href = m[8];
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        a.textContent = m[7];
        parent.append(a);
      }
      last = re.lastIndex;
    }
    if (last < text.length) appendText(parent, text.slice(last));
  }

  function appendText(parent, text) {
    const lines = text.split("\n");
    lines.forEach((line, i) => {
      if (i > 0) parent.append(document.createElement("br"));
      if (line) parent.append(document.createTextNode(line));
    });
  }

  function render(src) {
    const root = document.createDocumentFragment();
    const lines = src.replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    let para = [];
    const flush = () => {
      if (para.length) {
        const p = document.createElement("p");
        inline(para.join("\n"), p);
        root.append(p);
        para = [];
      }
    };
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/.exec(line))) {
        flush();
        const fence = m[1];
        const body = [];
        i++;
        while (i < lines.length && !new RegExp("^ {0,3}" + fence[0] + "{" + fence.length + ",}\\s*$").test(lines[i])) {
          body.push(lines[i]);
          i++;
        }
        i++; // the closing fence (a reply still streaming may not have it yet)
        const pre = document.createElement("pre");
        const code = document.createElement("code");
        if (m[2]) { code.className = "language-" + m[2]; pre.dataset.lang = m[2]; }
        code.textContent = body.join("\n");
        pre.append(code);
        root.append(pre);
        continue;
      }
      if ((m = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/.exec(line))) {
        flush();
        const h = document.createElement("h" + Math.min(6, m[1].length + 2));
        inline(m[2], h);
        root.append(h);
        i++;
        continue;
      }
      if (/^ {0,3}([-*_])(\s*\1){2,}\s*$/.test(line)) {
        flush();
        root.append(document.createElement("hr"));
        i++;
        continue;
      }
      if (/^ {0,3}>/.test(line)) {
        flush();
        const quote = [];
        while (i < lines.length && /^ {0,3}>/.test(lines[i])) {
          quote.push(lines[i].replace(/^ {0,3}> ?/, ""));
          i++;
        }
        const bq = document.createElement("blockquote");
        bq.append(render(quote.join("\n")));
        root.append(bq);
        continue;
      }
      if ((m = /^ {0,3}([-*+]|\d{1,9}[.)])\s+/.exec(line))) {
        flush();
        const ordered = /\d/.test(m[1]);
        const list = document.createElement(ordered ? "ol" : "ul");
        if (ordered && parseInt(m[1], 10) !== 1) list.start = parseInt(m[1], 10);
        const item = ordered ? /^ {0,3}\d{1,9}[.)]\s+(.*)$/ : /^ {0,3}[-*+]\s+(.*)$/;
        while (i < lines.length && item.test(lines[i])) {
          const li = document.createElement("li");
          let text = item.exec(lines[i])[1];
          i++;
          while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !item.test(lines[i])) {
            text += "\n" + lines[i].trim();
            i++;
          }
          inline(text, li);
          list.append(li);
        }
        root.append(list);
        continue;
      }
      if (/^( {4}|\t)/.test(line) && !para.length) {
        const body = [];
        while (i < lines.length && (/^( {4}|\t)/.test(lines[i]) || (!lines[i].trim() && i + 1 < lines.length && /^( {4}|\t)/.test(lines[i + 1])))) {
          body.push(lines[i].replace(/^( {4}|\t)/, ""));
          i++;
        }
        const pre = document.createElement("pre");
        const code = document.createElement("code");
        code.textContent = body.join("\n");
        pre.append(code);
        root.append(pre);
        continue;
      }
      if (!line.trim()) { flush(); i++; continue; }
      para.push(line);
      i++;
    }
    flush();
    return root;
  }
  return { render };
})();
