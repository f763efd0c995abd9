"""The query builder: what a text search asks tantivy, built in code from the user's text.

User text is never parsed as query syntax: the query is cut into terms by the very analyser the
index uses (composed, simple tokenizer, lowercase, accents folded, English stemmer) and those
terms are combined in code, so quotes, colons, parentheses, ``AND``, ``*`` and emoji are just
text. Every query carries a mandatory term on the user field.

Recall's ``where`` filters are translated here too (:meth:`QueryBuilder.where`), into a query
that matches exactly the documents the filter admits.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

import tantivy

from ..base.text import composed
from ..base.where import Node, regex_escape
from .index import COLUMNS

__all__ = ["QUERY_STOPWORDS", "TextFilters", "QueryBuilder"]


# Words a query drops before BM25 (NLTK's 127 English stopwords, plus the auxiliaries of
# questions): in "What did Caroline research?" only "caroline" and "research" carry signal, and
# a document rich in "what" and "did" must not outrank one that says "research". Indexed text
# keeps them (a query made only of these words still searches with them).
QUERY_STOPWORDS = frozenset(
    "i me my myself we our ours ourselves you your yours yourself yourselves he him his himself "
    "she her hers herself it its itself they them their theirs themselves what which who whom "
    "this that these those am is are was were be been being have has had having do does did "
    "doing a an the and but if or because as until while of at by for with about against "
    "between into through during before after above below to from up down in out on off over "
    "under again further then once here there when where why how all any both each few more "
    "most other some such no nor not only own same so than too very s t can will just don "
    "should now would could might likely also ever".split())


# Values of one filter up to which it is a union of term queries rather than one term-set
# query: tantivy's term-set query fills a bitset over the whole index before the search starts,
# and for one kind among 100k documents that doubled the cost of the search (0.8 ms against
# 0.4 ms here); a term query walks its posting list. Past a few values (an lsn list) the
# bitset wins.
SET_AFTER = 8


def any_of(schema: tantivy.Schema, field: str, values: list) -> tantivy.Query:
    """The documents with any of ``values`` in ``field`` (none for no values)."""
    Q = tantivy.Query
    if not values:
        return Q.empty_query()
    if len(values) == 1:
        return Q.term_query(schema, field, values[0])
    if len(values) <= SET_AFTER:
        return Q.boolean_query([(tantivy.Occur.Should, Q.term_query(schema, field, v))
                                for v in values])
    return Q.term_set_query(schema, field, list(values))


class TextFilters:
    """What a text search may return, beyond its user."""

    __slots__ = ("session_id", "since", "until", "roles", "kinds", "tags", "lsns", "where",
                 "exclude")

    def __init__(self, session_id: str | None = None, since: datetime | None = None,
                 until: datetime | None = None, roles: tuple[str, ...] | None = None,
                 kinds: tuple[str, ...] | None = None,
                 tags: tuple[str, ...] | None = None, lsns: list[int] | None = None,
                 where: Node | None = None, exclude: list[int] | None = None) -> None:
        self.session_id, self.since, self.until = session_id, since, until
        self.roles, self.kinds, self.tags = roles, kinds, tags
        self.lsns = lsns  # only these records (e.g. the facts a category filter admits)
        self.where = where  # a compiled ``where`` filter (``base.where.parse``)
        self.exclude = exclude  # never these (what a time-travelling recall's store lacked)


class QueryBuilder:
    """The queries over one index's schema, its text cut into terms by the index's analyser."""

    def __init__(self, schema: tantivy.Schema, analyzer: tantivy.TextAnalyzer) -> None:
        self._schema = schema
        self._analyzer = analyzer
        # The stopwords as the analyser leaves them (stemmed), to compare with query terms.
        self._stop = frozenset(self._analyzer.analyze(" ".join(QUERY_STOPWORDS)))

    def terms(self, text: str) -> list[str]:
        """The query's terms, as the index analyses text (deduplicated, in order)."""
        return list(dict.fromkeys(self._analyzer.analyze(composed(text))))

    def query_terms(self, text: str) -> list[str]:
        """The terms a query searches with: its terms without QUERY_STOPWORDS, or all of them
        when nothing else is left."""
        terms = self.terms(text)
        kept = [t for t in terms if t not in self._stop]
        return kept or terms

    def tagged(self, index: tantivy.Index, user_id: str, tags: tuple[str, ...] | None,
               where: Node | None) -> tantivy.Query:
        """The user's records carrying any of ``tags`` and passing ``where`` (either may be
        None).

        Args:
            index: the open index; its query parser reads ``where``'s range bounds.
        """
        Q, Occur, schema = tantivy.Query, tantivy.Occur, self._schema
        scope = [(Occur.Must, Q.term_query(schema, "user", user_id))]
        if tags is not None:
            scope.append((Occur.Must, any_of(schema, "tags", list(tags))))
        if where is not None:
            scope.append((Occur.Must, self.where(index, where)))
        return Q.boolean_query(scope)

    def search(self, index: tantivy.Index, user_id: str, terms: list[str],
               filters: TextFilters | None) -> tantivy.Query:
        """BM25 over any of ``terms``, among the user's records that pass ``filters``.

        Args:
            index: the open index; its query parser reads a ``where`` filter's range bounds.
            terms: the query's terms, as :meth:`query_terms` gives them (at least one).
        """
        Q, Occur, schema = tantivy.Query, tantivy.Occur, self._schema
        words = Q.boolean_query([(Occur.Should, Q.term_query(schema, "text", t)) for t in terms])
        scope = [(Occur.Must, Q.term_query(schema, "user", user_id))]
        if filters is not None:
            if filters.session_id is not None:
                scope.append((Occur.Must, Q.term_query(schema, "session", filters.session_id)))
            if filters.roles is not None:
                scope.append((Occur.Must, any_of(schema, "role", list(filters.roles))))
            if filters.kinds is not None:
                scope.append((Occur.Must, any_of(schema, "kind", list(filters.kinds))))
            if filters.tags is not None:
                scope.append((Occur.Must, any_of(schema, "tags", list(filters.tags))))
            if filters.lsns is not None:
                scope.append((Occur.Must, Q.term_set_query(schema, "lsn", list(filters.lsns))))
            if filters.exclude:
                scope.append((Occur.MustNot,
                              Q.term_set_query(schema, "lsn", list(filters.exclude))))
            if filters.since is not None or filters.until is not None:
                scope.append((Occur.Must, Q.range_query(
                    schema, "at", tantivy.FieldType.Date, filters.since, filters.until)))
            if filters.where is not None:
                scope.append((Occur.Must, self.where(index, filters.where)))
        # The scope only filters: a constant score of zero leaves the ranking to BM25.
        query = Q.boolean_query([(Occur.Must, words),
                                 (Occur.Must, Q.const_score_query(Q.boolean_query(scope), 0.0))])
        return query

    def where(self, index: tantivy.Index, node: Node) -> tantivy.Query:
        """A compiled ``where`` filter as a tantivy query that matches exactly the documents
        whose attributes ``node.matches`` (values and field names were checked by
        ``where.parse``: the range grammar below only ever sees a checked path and a number)."""
        Q, Occur, schema = tantivy.Query, tantivy.Occur, self._schema
        op = node.op
        if op == "and":
            return Q.boolean_query([(Occur.Must, self.where(index, c)) for c in node.children])
        if op == "or":
            return Q.boolean_query([(Occur.Should, self.where(index, c))
                                    for c in node.children])
        if op in ("not", "ne", "nin"):
            inner = (node.children[0] if op == "not"
                     else Node("eq" if op == "ne" else "in", node.path, node.value))
            return Q.boolean_query([(Occur.Must, Q.all_query()),
                                    (Occur.MustNot, self.where(index, inner))])
        space, *rest = node.path
        column = COLUMNS.get(rest[0]) if space == "f" else None
        value = node.value
        if op == "contains":
            if column is not None:
                return Q.regex_query(schema, column, f"(?s).*{regex_escape(value)}.*")
            prefix = regex_escape(".".join(node.path))
            return Q.regex_query(schema, "attr_str", f"(?s){prefix}\x00.*{regex_escape(value)}.*")
        if op in ("eq", "in"):
            values = (value,) if op == "eq" else value
            if column is not None:  # text columns: only strings can match
                strings = [v for v in values if type(v) is str]
                return any_of(schema, column, strings)
            path = "attrs." + ".".join(node.path)
            terms = [Q.term_query(schema, path, v) for v in values]
            return terms[0] if len(terms) == 1 else Q.boolean_query(
                [(Occur.Should, t) for t in terms])
        if column is not None:  # a range over a text column matches nothing
            return Q.empty_query()
        bound = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}[op]
        path = "attrs." + ".".join(node.path)
        query = index.parse_query(f"{path}:{bound}{_positional(value)}", ["attrs"])
        if value == 0 and op in ("gte", "lt"):
            # The index sorts a stored -0.0 below 0.0, where Python (and its term for 0) has
            # them equal: gte 0 must take it, lt 0 must not.
            zero = Q.term_query(schema, path, 0)
            if op == "gte":
                return Q.boolean_query([(Occur.Should, query), (Occur.Should, zero)])
            return Q.boolean_query([(Occur.Must, query), (Occur.MustNot, zero)])
        return query


def _positional(value: int | float) -> str:
    """A range bound as the query grammar reads it: a float in positional notation (the grammar
    takes ``-1e-05`` for a syntax error), exactly the double ``value`` is nearest to."""
    text = format(Decimal(repr(float(value))), "f")
    return text if "." in text else f"{text}.0"
