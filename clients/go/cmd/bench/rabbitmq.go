package main

// RabbitMQ: a topic exchange of its own a round, and the two quorum queues the runtime
// declares for a code-defined subscription, bound to it; the bare side is an amqp091-go
// consumer with manual acknowledgement and the runtime's prefetch (maxInFlight), acking each.

import (
	"context"
	"fmt"
	"os"

	amqp "github.com/rabbitmq/amqp091-go"

	messaging "settle.dev/messaging"
	"settle.dev/messaging/rabbitmq"
)

func rabbitPlace(ctx context.Context, url string, round, messages int) (place, error) {
	conn, err := amqp.Dial(url)
	if err != nil {
		return place{}, err
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		return place{}, err
	}
	exchange := fmt.Sprintf("settle.gobench.%d.%d", os.Getpid(), round)
	if err := ch.ExchangeDeclare(exchange, "topic", false, true, false, false, nil); err != nil {
		_ = conn.Close()
		return place{}, err
	}
	spec := func(durable string) messaging.SubscriptionSpec {
		return messaging.SubscriptionSpec{Name: "bench-" + durable, Pattern: "orders.>", DurableName: fmt.Sprintf("gobench-%d-%d-%s", os.Getpid(), round, durable), MaxDeliver: 5}
	}
	backend := func() (*rabbitmq.Broker, error) {
		b, err := rabbitmq.Connect(url)
		if err != nil {
			return nil, err
		}
		return b.WithExchange(exchange), nil
	}
	var opened []*rabbitmq.Broker
	cleanup := func() {
		for _, b := range opened {
			b.Close()
		}
		for _, d := range []string{"bare", "runtime"} {
			_, _ = ch.QueueDelete(spec(d).DurableName, false, false, false)
		}
		_ = ch.ExchangeDelete(exchange, false, false)
		_ = conn.Close()
	}
	for _, d := range []string{"bare", "runtime"} {
		b, err := backend()
		if err == nil {
			opened = append(opened, b)
			err = made(ctx, b, spec(d))
		}
		if err != nil {
			cleanup()
			return place{}, err
		}
	}
	rt, err := backend()
	if err != nil {
		cleanup()
		return place{}, err
	}
	opened = append(opened, rt)
	p := place{runtime: rt, spec: spec("runtime"), cleanup: cleanup}
	p.bare = func() error {
		c, err := conn.Channel()
		if err != nil {
			return err
		}
		defer c.Close()
		s := spec("bare")
		s.Mode = messaging.AtLeastOnce
		if err := c.Qos(s.Resolve().MaxInFlight, 0, false); err != nil {
			return err
		}
		in, err := c.Consume(s.DurableName, "bare", false, false, false, false, nil)
		if err != nil {
			return err
		}
		for range messages {
			d, ok := <-in
			if !ok {
				return fmt.Errorf("the bare consumer's channel closed")
			}
			if err := d.Ack(false); err != nil {
				return err
			}
		}
		return nil
	}
	// Published with confirms, both queues get every message.
	if err := ch.Confirm(false); err != nil {
		cleanup()
		return place{}, err
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, messages))
	for range messages {
		if err := ch.PublishWithContext(ctx, exchange, "orders.1", false, false, amqp.Publishing{Body: payload}); err != nil {
			cleanup()
			return place{}, err
		}
	}
	for range messages {
		if c := <-confirms; !c.Ack {
			cleanup()
			return place{}, fmt.Errorf("the broker refused a message (basic.nack)")
		}
	}
	return p, nil
}
