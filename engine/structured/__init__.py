"""Structured outputs: a JSON schema, regex or choice as a canvas layout (skeleton + slots) and
per-step token masks (docs/structured-outputs.md). `schema` and `regexes` are pure Python;
`constraint` compiles layouts and holds a request's slot matchers (llguidance)."""
