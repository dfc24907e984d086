package sqs_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	messaging "settle.dev/messaging"
	"settle.dev/messaging/sqs"
)

// onElasticMQ is a broker with a queue prefix of the test's own on the environment's
// ElasticMQ, and a bus on it without reports.
func onElasticMQ(t *testing.T) (*sqs.Broker, *messaging.Bus, string) {
	if testing.Short() {
		t.Skip("needs the environment's ElasticMQ: `make test` runs it")
	}
	endpoint := os.Getenv("SETTLE_SQS_ENDPOINT")
	if endpoint == "" {
		t.Fatal("SETTLE_SQS_ENDPOINT is not set: start the environment (`make env-up`, then `source target/env/settle.env`); `make test` does both")
	}
	prefix := fmt.Sprintf("gosqs-%d-%d-", os.Getpid(), time.Now().UnixNano()%1_000_000)
	b, err := sqs.Connect(sqs.Settings{Region: "elasticmq", Endpoint: endpoint, AccessKeyID: "test", SecretAccessKey: "test", QueuePrefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	b = b.WithLongPoll(1)
	return b, messaging.New(b, messaging.Options{NoReports: true}), prefix
}

// P1 on SQS: a receive asks for no more messages than the subscription has free slots, so no
// received message waits untaken while its visibility runs. With three slots held by running
// handlers and twenty messages waiting, SQS shows exactly three in flight.
func TestAReceiveTakesNoMoreThanTheFreeSlots(t *testing.T) {
	b, bus, prefix := onElasticMQ(t)
	ctx := context.Background()
	release := make(chan struct{})
	var started atomic.Int64
	err := bus.Subscribe(ctx, messaging.SubscriptionSpec{
		Name: "held", Pattern: "held", DurableName: "held", Mode: messaging.AtLeastOnce, MaxDeliver: 5, MaxInFlight: 3,
		Handler: func(_ context.Context, d messaging.Delivery) error {
			started.Add(1)
			<-release
			return d.Ack()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	c := b.Client()
	t.Cleanup(func() {
		bus.Close()
		if out, err := c.GetQueueUrl(context.Background(), &awssqs.GetQueueUrlInput{QueueName: aws.String(prefix + "held")}); err == nil {
			_, _ = c.DeleteQueue(context.Background(), &awssqs.DeleteQueueInput{QueueUrl: out.QueueUrl})
		}
	})
	for i := range 20 {
		if err := b.Publish(ctx, "held", []byte(strconv.Itoa(i)), nil); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for started.Load() < 3 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(2 * time.Second) // a receive that would take more has had its chance
	out, err := c.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(prefix + "held")})
	if err != nil {
		t.Fatal(err)
	}
	attrs, err := c.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{QueueUrl: out.QueueUrl,
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameApproximateNumberOfMessagesNotVisible}})
	if err != nil {
		t.Fatal(err)
	}
	if got := attrs.Attributes[string(types.QueueAttributeNameApproximateNumberOfMessagesNotVisible)]; got != "3" || started.Load() != 3 {
		t.Fatalf("in flight on SQS %s, handlers started %d; want 3 and 3 (maxInFlight)", got, started.Load())
	}
	close(release)
	deadline = time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if st, _ := bus.Stats("held"); st.Settlement.Acked == 20 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	st, _ := bus.Stats("held")
	t.Fatalf("acked %d of 20", st.Settlement.Acked)
}

// With fewer slots free than a receive wants, it waits at most a moment for more to free
// (batch's gatherFor), then takes what is free: two of three slots held for the whole test,
// the messages behind them are still handled one by one.
func TestAReceiveWithFewSlotsFreeDoesNotWaitForMore(t *testing.T) {
	b, bus, prefix := onElasticMQ(t)
	ctx := context.Background()
	release := make(chan struct{})
	var held, acked atomic.Int64
	err := bus.Subscribe(ctx, messaging.SubscriptionSpec{
		Name: "few", Pattern: "few", DurableName: "few", Mode: messaging.AtLeastOnce, MaxDeliver: 5, MaxInFlight: 3,
		Handler: func(_ context.Context, d messaging.Delivery) error {
			if string(d.Payload()) == "hold" {
				held.Add(1)
				<-release
			}
			err := d.Ack()
			acked.Add(1)
			return err
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	c := b.Client()
	t.Cleanup(func() {
		close(release)
		bus.Close()
		if out, err := c.GetQueueUrl(context.Background(), &awssqs.GetQueueUrlInput{QueueName: aws.String(prefix + "few")}); err == nil {
			_, _ = c.DeleteQueue(context.Background(), &awssqs.DeleteQueueInput{QueueUrl: out.QueueUrl})
		}
	})
	for range 2 {
		if err := b.Publish(ctx, "few", []byte("hold"), nil); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for held.Load() < 2 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	for i := range 5 {
		if err := b.Publish(ctx, "few", []byte(strconv.Itoa(i)), nil); err != nil {
			t.Fatal(err)
		}
	}
	for acked.Load() < 5 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if held.Load() != 2 || acked.Load() != 5 {
		t.Fatalf("held %d, acked %d behind them; want 2 and 5", held.Load(), acked.Load())
	}
}
