"""The API surface: the HTTP routes (OpenAI, Anthropic, admin, dashboard), their OpenAPI document and
access control. The request model they parse into (hints, validation, errors) is ``frontend/request``."""
