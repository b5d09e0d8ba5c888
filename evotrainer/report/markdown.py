"""A safe subset of Markdown for the descriptions a project or version spec carries.

markdown-it-py (a dependency of rich) with every rule off but paragraphs, emphasis, code,
lists, block quotes and links; raw HTML is never passed through (it shows as text), headings
and images stay text, and a link leads only to http(s) or mailto: anything else (javascript:,
data:, a relative path into the report) stays the literal text the author wrote."""

from __future__ import annotations

from markdown_it import MarkdownIt
from markdown_it.token import Token
from markupsafe import Markup

from evotrainer.terminal import clean

LINK_SCHEMES = ("http://", "https://", "mailto:")
_RULES = ["emphasis", "backticks", "escape", "entity", "newline", "link", "autolink",
          "reference", "list", "blockquote", "code", "fence"]


def _link_allowed(url: str) -> bool:
    return url.lower().startswith(LINK_SCHEMES)


def _external_link(self, tokens: list[Token], idx: int, options, env) -> str:
    # The report is read offline from disk: a link leaves it, and tells the target nothing.
    tokens[idx].attrSet("rel", "nofollow noopener noreferrer")
    return self.renderToken(tokens, idx, options, env)


def _parser() -> MarkdownIt:
    md = MarkdownIt("zero", {"html": False, "linkify": False, "typographer": False})
    md.enable(_RULES)
    md.validateLink = _link_allowed
    md.add_render_rule("link_open", _external_link)
    return md


_MARKDOWN = _parser()


def render(text: object) -> Markup:
    """`text` as HTML (Markup, safe to place as is); None or empty gives an empty string."""
    if text is None or text == "":
        return Markup("")
    return Markup(_MARKDOWN.render(clean(str(text))))
