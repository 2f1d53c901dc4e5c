"""Dispatch and streaming: the request's lease (booked -> first token -> released), the HTTP
client to the engines, the stream relay, unary reassembly, migration and the API stream dialects."""
