"""The Slack plugin's plain rules: which events are answered, markdown → mrkdwn, splitting, proxies."""

from __future__ import annotations

import random

import pytest

from plugins._slack_events import EventFilter, InboundMessage
from plugins._slack_text import split_message, to_mrkdwn
from plugins.plugin_client_slack import proxy_for

FENCE = "```"


# ── markdown → mrkdwn ───────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(("markdown", "mrkdwn"), [
    ("**bold** and *italic* and ~~gone~~", "*bold* and _italic_ and ~gone~"),
    ("# Title\n\nText", "*Title*\n\nText"),
    ("[docs](https://example.com/a_b)", "<https://example.com/a_b|docs>"),
    ("- one\n- **two**", "•   one\n•   *two*"),
    ("1. first\n2. second", "1.  first\n2.  second"),
    ("a < b & c > d", "a &lt; b &amp; c &gt; d"),
    ("`x<y && z`", "`x&lt;y &amp;&amp; z`"),
    ("```python\nif a < b:\n    pass\n```", "```\nif a &lt; b:\n    pass\n```"),
    ("ask <@U123> in <#C9>", "ask <@U123> in <#C9>"),  # user and channel mentions stay live
    ("hey <!channel> and <!here>", "hey &lt;!channel&gt; and &lt;!here&gt;"),  # broadcasts do not
    ("snake_case_name stays", "snake_case_name stays"),
])
def test_markdown_becomes_slack_mrkdwn(markdown, mrkdwn):
    assert to_mrkdwn(markdown) == mrkdwn


def test_an_unclosed_code_block_is_closed():
    assert to_mrkdwn("Here:\n```\nx = 1") == "Here:\n\n```\nx = 1\n```"


# ── splitting ───────────────────────────────────────────────────────────────────────────────


def _content(chunks: list[str]) -> list[str]:
    return [line for chunk in chunks for line in chunk.split("\n") if line.strip() and line != FENCE]


def test_a_short_message_is_one_chunk():
    assert split_message("hello\n\nworld", 100) == ["hello\n\nworld"]


def test_a_code_block_across_a_cut_is_closed_and_reopened():
    code = "\n".join(f"row {i:02d}" for i in range(30))
    chunks = split_message(f"intro\n\n{FENCE}\n{code}\n{FENCE}\n\noutro", 120)
    assert len(chunks) == 2 and all(len(c) <= 120 and c.count(FENCE) % 2 == 0 for c in chunks)
    assert chunks[0].endswith(f"row 14\n{FENCE}") and chunks[1].startswith(f"{FENCE}\nrow 15")
    assert _content(chunks) == ["intro", *code.split("\n"), "outro"]


def test_cuts_prefer_paragraph_boundaries():
    paragraphs = [f"{n} " + "word " * 25 for n in ("first", "second", "third")]
    chunks = split_message("\n\n".join(p.strip() for p in paragraphs), 300)
    assert chunks == ["\n\n".join(p.strip() for p in paragraphs[:2]), paragraphs[2].strip()]


def test_a_long_line_is_cut_at_spaces_and_a_long_word_anywhere():
    words = " ".join(f"w{i}" for i in range(300))
    chunks = split_message(words, 200)
    assert all(len(c) <= 200 for c in chunks) and " ".join(chunks).split() == words.split()
    url = "https://example.com/" + "x" * 700
    chunks = split_message(url, 200)
    assert all(len(c) <= 200 for c in chunks) and "".join(chunks) == url


def test_a_long_code_line_stays_inside_code_in_every_chunk():
    line = "y = " + "1 + " * 200 + "1"
    chunks = split_message(f"{FENCE}\n{line}\n{FENCE}", 200)
    assert all(len(c) <= 200 and c.startswith(f"{FENCE}\n") and c.endswith(f"\n{FENCE}") for c in chunks)
    assert "".join(c[len(FENCE) + 1:-len(FENCE) - 1] for c in chunks) == line


@pytest.mark.parametrize("seed", range(20))
def test_random_answers_split_within_the_limit_with_balanced_code(seed):
    rnd = random.Random(seed)
    blocks = []
    for _ in range(rnd.randint(5, 40)):
        if rnd.random() < 0.3:
            body = [f"  code {rnd.randint(0, 999)} " + "z" * rnd.randint(0, 60) for _ in range(rnd.randint(1, 30))]
            blocks.append("\n".join([FENCE, *body, FENCE]))
        else:
            blocks.append(" ".join(f"t{rnd.randint(0, 99)}" for _ in range(rnd.randint(1, 40))))
    text = "\n\n".join(blocks)
    limit = rnd.choice([200, 350, 1000])
    chunks = split_message(text, limit)
    assert all(len(c) <= limit for c in chunks), [len(c) for c in chunks]
    assert all(c.count(FENCE) % 2 == 0 for c in chunks)
    assert _content(chunks) == _content([text])


# ── which events are answered ───────────────────────────────────────────────────────────────


def make_filter(known: tuple[str, ...] = ()) -> EventFilter:
    return EventFilter("UBOT", "BBOT", lambda client_id: client_id in known)


def payload(event: dict, event_id: str = "Ev1") -> dict:
    return {"type": "event_callback", "event_id": event_id, "event": event}


def ev(**fields) -> dict:
    return {"type": "message", "user": "U1", "channel": "C1", "channel_type": "channel", "ts": "100.000001",
            "text": "hi", **fields}


def test_a_mention_starts_a_thread_and_loses_the_bot_mention():
    got = make_filter().accept(payload(ev(type="app_mention", text="<@UBOT> 2 &lt; 3 &amp;&amp; <@U2>")))
    assert got == InboundMessage("C1", "100.000001", "100.000001", "U1", "2 < 3 && <@U2>")
    assert got.client_id == "slack-C1-100.000001"


def test_a_mention_inside_a_thread_answers_in_that_thread():
    got = make_filter().accept(
        payload(ev(type="app_mention", text="<@UBOT|agent> more", ts="101.5", thread_ts="100.1"))
    )
    assert isinstance(got, InboundMessage) and got.thread_ts == "100.1" and got.text == "more"


@pytest.mark.parametrize(("event", "known", "answered"), [
    (ev(channel="D1", channel_type="im"), (), True),                                    # DM
    (ev(channel="D1", channel_type="im", thread_ts="99.1"), (), True),                  # DM thread reply
    (ev(thread_ts="99.1"), ("slack-C1-99.1",), True),                                   # reply in the bot's thread
    (ev(thread_ts="99.1"), (), False),                                                  # someone else's thread
    (ev(), (), False),                                                                  # plain channel chatter
    (ev(subtype="file_share", channel="D1", channel_type="im"), (), True),
    (ev(subtype="thread_broadcast", thread_ts="99.1"), ("slack-C1-99.1",), True),
    (ev(subtype="message_changed", channel="D1", channel_type="im"), (), False),
    (ev(subtype="message_deleted", channel="D1", channel_type="im"), (), False),
    (ev(subtype="bot_message", channel="D1", channel_type="im", bot_id="B2"), (), False),
    (ev(channel="D1", channel_type="im", bot_id="BBOT"), (), False),                    # our own post
    (ev(channel="D1", channel_type="im", user="UBOT"), (), False),                      # our own user
    (ev(channel="D1", channel_type="im", user="U5", bot_id="B5"), (), False),           # another bot
    (ev(type="reaction_added"), (), False),
    (ev(channel="../../etc", channel_type="im"), (), False),                            # malformed ids
    (ev(channel="D1", channel_type="im", ts="yesterday"), (), False),
    (ev(channel="D1", channel_type="im", user=None), (), False),
])
def test_which_events_are_answered(event, known, answered):
    got = make_filter(known).accept(payload(event))
    assert isinstance(got, InboundMessage) is answered, got


def test_each_event_and_each_message_is_handled_once():
    f = make_filter()
    mention = ev(type="app_mention", text="<@UBOT> hi", channel="D1", channel_type="im")
    assert isinstance(f.accept(payload(mention, "Ev1")), InboundMessage)
    assert f.accept(payload(mention, "Ev1")) == "repeated delivery of an event"
    same_post = {**mention, "type": "message", "text": "<@UBOT> hi"}
    assert f.accept(payload(same_post, "Ev2")) == "message already handled (mention and message of one post)"
    assert f.accept({"type": "url_verification"}) == "payload type 'url_verification'"


def test_the_memory_of_seen_events_is_bounded():
    f = make_filter()
    for i in range(5000):
        f.accept(payload(ev(channel="D1", channel_type="im", ts=f"{i}.1"), f"Ev{i}"))
    assert len(f._events._keys) <= 4096 and len(f._messages._keys) <= 4096


# ── proxies ─────────────────────────────────────────────────────────────────────────────────


def test_proxy_settings_honour_no_proxy_and_loopback(monkeypatch):
    for var in ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    assert proxy_for("https://slack.com/api/") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    assert proxy_for("https://slack.com/api/") == "http://proxy.internal:3128"
    assert proxy_for("http://127.0.0.1:9999/api/") is None
    monkeypatch.setenv("NO_PROXY", "slack.com")
    assert proxy_for("https://slack.com/api/") is None
