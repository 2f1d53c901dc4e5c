"""The API surface: the HTTP routes (OpenAI, Anthropic, admin, dashboard), their request and
response shapes, errors, validation, request hints (nvext, x-dynamo-* headers) and access control."""
