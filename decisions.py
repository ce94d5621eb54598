"""The gate decision vocabulary: the words a gate's answer can be, what each client calls them, and
how long a timed grant lasts unless told.

One source for the server (grants, the gate keeper, approvals) and every client surface (shell,
API, MCP, Slack). It imports nothing, so the shell client process loads it without the server.
"""

#: Decisions a gate accepts: once, a grant of one of the scopes below, or no.
ALLOW, REJECT = "allow", "reject"
TIMED, SESSION, PATTERN = "allow_for", "allow_session", "allow_pattern"
GRANT_SCOPES = (TIMED, SESSION, PATTERN)
DECISIONS = (ALLOW, *GRANT_SCOPES, REJECT)
#: Minutes of a timed grant (TIMED) when the answer names none, and the most it may name.
DEFAULT_MINUTES = 15
MAX_MINUTES = 24 * 60

#: How far a yes reaches, by name: the API's `scope` of an approving answer and the metrics' label.
SCOPE_NAMES = {ALLOW: "once", TIMED: "minutes", SESSION: "session", PATTERN: "pattern"}
#: The words of MCP's `answer_gate` (and its elicitation form), which names "allow once" explicitly.
MCP_WORDS = {"allow_once": ALLOW, TIMED: TIMED, SESSION: SESSION, PATTERN: PATTERN, REJECT: REJECT}
