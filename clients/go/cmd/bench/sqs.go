package main

// SQS: the two queues the runtime makes for a code-defined subscription, under a prefix of
// their own a round; the bare side is an aws-sdk-go-v2 loop that receives the way the runtime
// does (ten messages a call, as many as its free slots; its visibility and attributes,
// sqs/consume.go) and deletes each of a batch on a goroutine of its own, as a handler that
// acks does once the runtime hands it off.

import (
	"context"
	"fmt"
	"os"
	"sync"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	messaging "settle.dev/messaging"
	"settle.dev/messaging/sqs"
)

func sqsPlace(ctx context.Context, endpoint string, round, messages int) (place, error) {
	prefix := fmt.Sprintf("gobench-%d-%d-", os.Getpid(), round)
	backend := func() (*sqs.Broker, error) {
		b, err := sqs.Connect(sqs.Settings{Region: "elasticmq", Endpoint: endpoint, AccessKeyID: "test", SecretAccessKey: "test", QueuePrefix: prefix})
		if err != nil {
			return nil, err
		}
		return b.WithLongPoll(1), nil
	}
	spec := func(name string) messaging.SubscriptionSpec {
		// Ten in flight on both sides: the bare side's batch, deleted at once.
		return messaging.SubscriptionSpec{Name: name, Pattern: name, DurableName: name, MaxDeliver: 5, MaxInFlight: 10}
	}
	admin, err := backend()
	if err != nil {
		return place{}, err
	}
	c := admin.Client()
	cleanup := func() {
		for _, q := range []string{"bare", "runtime"} {
			if out, err := c.GetQueueUrl(context.Background(), &awssqs.GetQueueUrlInput{QueueName: aws.String(prefix + q)}); err == nil {
				_, _ = c.DeleteQueue(context.Background(), &awssqs.DeleteQueueInput{QueueUrl: out.QueueUrl})
			}
		}
	}
	urls := map[string]*string{}
	for _, q := range []string{"bare", "runtime"} {
		if err := made(ctx, admin, spec(q)); err != nil {
			cleanup()
			return place{}, err
		}
		out, err := c.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(prefix + q)})
		if err != nil {
			cleanup()
			return place{}, err
		}
		urls[q] = out.QueueUrl
	}
	rt, err := backend()
	if err != nil {
		cleanup()
		return place{}, err
	}
	p := place{runtime: rt, spec: spec("runtime"), cleanup: cleanup}
	s := spec("bare")
	s.Mode = messaging.AtLeastOnce
	visibility := int32(max(s.Resolve().AckWait.Seconds(), 1))
	p.bare = func() error {
		for left := messages; left > 0; {
			out, err := c.ReceiveMessage(ctx, &awssqs.ReceiveMessageInput{
				QueueUrl: urls["bare"], MaxNumberOfMessages: 10, WaitTimeSeconds: 1, VisibilityTimeout: visibility,
				MessageSystemAttributeNames: []types.MessageSystemAttributeName{
					types.MessageSystemAttributeNameApproximateReceiveCount, types.MessageSystemAttributeNameApproximateFirstReceiveTimestamp},
				MessageAttributeNames: []string{"All"},
			})
			if err != nil {
				return err
			}
			var wg sync.WaitGroup
			errs := make([]error, len(out.Messages))
			for i, m := range out.Messages {
				wg.Go(func() {
					_, errs[i] = c.DeleteMessage(ctx, &awssqs.DeleteMessageInput{QueueUrl: urls["bare"], ReceiptHandle: m.ReceiptHandle})
				})
			}
			wg.Wait()
			for _, err := range errs {
				if err != nil {
					return err
				}
			}
			left -= len(out.Messages)
		}
		return nil
	}
	// Sent ten to a call, to both queues.
	for _, q := range []string{"bare", "runtime"} {
		for sent := 0; sent < messages; {
			var batch []types.SendMessageBatchRequestEntry
			for i := 0; i < 10 && sent < messages; i++ {
				batch = append(batch, types.SendMessageBatchRequestEntry{Id: aws.String(fmt.Sprint(i)), MessageBody: aws.String(string(payload))})
				sent++
			}
			out, err := c.SendMessageBatch(ctx, &awssqs.SendMessageBatchInput{QueueUrl: urls[q], Entries: batch})
			if err == nil && len(out.Failed) > 0 {
				err = fmt.Errorf("SendMessageBatch: %d refused: %s", len(out.Failed), aws.ToString(out.Failed[0].Message))
			}
			if err != nil {
				cleanup()
				return place{}, err
			}
		}
	}
	return p, nil
}
