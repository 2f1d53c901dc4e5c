"""The request model, below every layer that handles requests: what a generation request may say
(validation), its routing hints (nvext, ``x-dynamo-*`` headers, session identity) and the errors it
answers with (OpenAI- and Anthropic-shaped). It imports nothing from ``frontend``'s other packages,
so the routes, the request path, the router and the pool can all use it."""
