"""The wire and the brokers: the envelope and its signed headers, the message bus port, and one
layer over each broker (RabbitMQ, Kafka, NATS JetStream, Redis Streams)."""
