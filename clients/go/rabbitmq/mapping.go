package rabbitmq

// The one spec → queue mapping of this runtime (the Rust runtime's `rabbitmq::mapping`): the
// queue's name, its arguments and its binding. It must not talk to the broker.

import (
	"fmt"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	messaging "settle.dev/messaging"
)

// OwnerArg names the Subscription (namespace/name) a queue Settle made belongs to.
const OwnerArg = "x-settle-subscription"

// codeDefinedExpires: how long the broker keeps an unused queue a code-defined subscription
// declared under a derived name.
const codeDefinedExpires = 5 * time.Minute

// QueueName is the queue of a Subscription: its durable name, or (only under AtMostOnce)
// settle_<namespace>_<name> with `.` as `_`.
func QueueName(namespace, name string, p messaging.Policy) string {
	if p.DurableName != "" {
		return p.DurableName
	}
	return fmt.Sprintf("settle_%s_%s", namespace, strings.ReplaceAll(name, ".", "_"))
}

// RoutingKey is the topic-exchange key of a subject pattern: `*` stays, `>` becomes `#`.
func RoutingKey(pattern string) string {
	words := strings.Split(pattern, ".")
	for i, w := range words {
		if w == ">" {
			words[i] = "#"
		}
	}
	return strings.Join(words, ".")
}

// arguments are the queue's: a quorum queue, its owner, and under AtLeastOnce the delivery
// limit (maxDeliver N is a limit of N−1 returns) and the dead-letter exchange.
func arguments(namespace, name string, p messaging.Policy, deadLetter string, byRuntime bool) amqp.Table {
	t := amqp.Table{"x-queue-type": "quorum", OwnerArg: namespace + "/" + name}
	if p.AtLeastOnce() {
		if p.MaxDeliver > 0 {
			t["x-delivery-limit"] = int64(p.MaxDeliver - 1)
		}
		if deadLetter != "" {
			t["x-dead-letter-exchange"] = deadLetter
		}
	}
	if byRuntime && p.DurableName == "" {
		t["x-expires"] = codeDefinedExpires.Milliseconds()
	}
	return t
}
