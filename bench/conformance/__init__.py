"""The conformance run (`make conformance`): property-based fuzzing of the KServe v2 routes this
server exposes (openapi_v2.yaml, with schemathesis), route probes and a raw request-line fuzz
against a fresh `make serve` stack, checking that no answer is a 5xx and every JSON answer is one
a strict RFC 8259 parser accepts."""
