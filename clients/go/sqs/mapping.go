package sqs

// The one spec → queue mapping of this runtime (the Rust runtime's `sqs::mapping` and
// `sqs::hold`): the queue's name and attributes, its dead-letter queue, and how long SQS may
// hold a message. It must not talk to SQS.

import (
	"encoding/json"
	"fmt"
	"time"

	messaging "settle.dev/messaging"
)

const (
	dlqSuffix       = "-dlq"
	nameMax         = 80
	maxReceiveCount = 1000
	dlqRetention    = 14 * 24 * 3600
	reportsSuffix   = "-settle-stats.fifo"
	// HoldLimit: SQS cannot hide a message past twelve hours from its first receive (Q4).
	HoldLimit = 12 * time.Hour
	ownerTag  = "settle-subscription"
	objectTag = "settle-object"
	pauseTag  = "settle-paused"
)

// queueSpec is the queue a subscription needs.
type queueSpec struct {
	name       string
	visibility int32
	dlq        string // "" without a redrive
	maxReceive int
}

func ceilSecs(d time.Duration) int64 {
	s := int64(d / time.Second)
	if d%time.Second > 0 {
		s++
	}
	return s
}

// visibilitySecs is ackWait as a visibility timeout: whole seconds, rounded up, 1 s to the
// hold limit.
func visibilitySecs(ackWait time.Duration) int32 {
	return int32(min(max(ceilSecs(ackWait), 1), int64(HoldLimit/time.Second)))
}

func validName(n string) bool {
	if n == "" || len(n) > nameMax {
		return false
	}
	for _, c := range n {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// desired is the queue `<prefix><durableName>` (or the pattern, equal to it by the admission
// rules), with a dead-letter queue `<name>-dlq` receiving what ran out of maxDeliver.
func desired(prefix string, p messaging.Policy) (queueSpec, error) {
	base := p.DurableName
	if base == "" {
		base = p.Pattern
	}
	q := queueSpec{name: prefix + base, visibility: visibilitySecs(p.AckWait)}
	if p.AtLeastOnce() && p.MaxDeliver > 0 {
		if p.MaxDeliver > maxReceiveCount {
			return q, fmt.Errorf("maxDeliver %d is more than SQS's largest maxReceiveCount (%d): set spec.maxDeliver to %d or less", p.MaxDeliver, maxReceiveCount, maxReceiveCount)
		}
		q.dlq, q.maxReceive = q.name+dlqSuffix, p.MaxDeliver
	}
	longest := q.name
	if q.dlq != "" {
		longest = q.dlq
	}
	if !validName(q.name) || !validName(longest) {
		return q, fmt.Errorf("queue name %q is not a valid SQS queue name (at most %d characters with the %s of its dead-letter queue; letters, digits, '-' and '_'): use a shorter durableName or queue prefix", q.name, nameMax, dlqSuffix)
	}
	return q, nil
}

func redrivePolicy(dlqARN string, maxReceive int) string {
	b, _ := json.Marshal(map[string]any{"deadLetterTargetArn": dlqARN, "maxReceiveCount": maxReceive})
	return string(b)
}

// reportQueue is the report queue beside queue, within SQS's 80 characters.
func reportQueue(queue string) string {
	full := queue + reportsSuffix
	if len(full) <= nameMax {
		return full
	}
	keep := nameMax - len(reportsSuffix) - 9
	return fmt.Sprintf("%s-%08x%s", queue[:keep], uint32(fnv(queue)), reportsSuffix)
}

// hold is how long a decline of delay may hide a message first received at first (Unix ms):
// whole seconds, within HoldLimit from the first receive; shortened when it does not fit.
func hold(firstMs, nowMs int64, delay, limit time.Duration) (seconds int32, shortened bool) {
	asked := ceilSecs(delay)
	held := max(nowMs-firstMs, 0)
	left := max(limit.Milliseconds()-held, 0) / 1000
	if asked <= left {
		return int32(asked), false
	}
	return int32(left), true
}
