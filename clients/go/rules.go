package messaging

// The admission rules a subscription meets when it is added to a bus (docs/semantics.md A1–A5,
// A7, A9–A12, A15): the same findings, in the same words, as the Rust runtime's
// `policy::validate_runtime` and the webhook, checked against shared vectors
// (conformance/admission.json). Pure: no I/O, no clock.

import (
	"fmt"
	"strings"
	"time"
)

// FieldIssue is one finding about one field.
type FieldIssue struct {
	Field   string `json:"field"`
	Message string `json:"message"`
}

func (f FieldIssue) String() string { return f.Field + ": " + f.Message }

// Verdict is what the rules concluded: errors refuse the spec, warnings admit it.
type Verdict struct {
	Errors   []FieldIssue `json:"errors"`
	Warnings []FieldIssue `json:"warnings"`
}

func (v *Verdict) err(field, msg string)  { v.Errors = append(v.Errors, FieldIssue{field, msg}) }
func (v *Verdict) warn(field, msg string) { v.Warnings = append(v.Warnings, FieldIssue{field, msg}) }

// ErrorText is every error in one line, as the webhook and the CLI print them.
func (v Verdict) ErrorText() string {
	parts := make([]string, len(v.Errors))
	for i, e := range v.Errors {
		parts[i] = e.String()
	}
	return strings.Join(parts, "; ")
}

// FormatDuration writes a duration as Settle does (Go's form, with "us" for microseconds).
func FormatDuration(d time.Duration) string {
	return strings.ReplaceAll(d.String(), "µs", "us")
}

const queueNameMax = 80

// Validate judges a spec against a backend's capabilities.
func Validate(s SubscriptionSpec, caps Capabilities) Verdict {
	var v Verdict
	policyRules(&v, s, caps)
	if s.Stream != "" && !caps.NamedStreams {
		v.err("spec.stream", fmt.Sprintf("%q names a JetStream stream, and this backend has no named streams (it does not declare "+
			"namedStreams): its queue is the Subscription's own (on RabbitMQ bound to the Backend's exchange "+
			"by spec.pattern, on SQS named by spec.durableName). Remove spec.stream", s.Stream))
	}
	return v
}

func policyRules(v *Verdict, s SubscriptionSpec, caps Capabilities) {
	alo := s.Mode == AtLeastOnce
	if alo && s.DurableName == "" {
		v.err("spec.durableName", "required under mode AtLeastOnce, on every backend: set spec.durableName to a stable name "+
			"(for example the Subscription's name) so redeliveries survive a restart")
	}
	b := s.Backoff
	if b.Set() {
		if b.Multiplier == 0 {
			b.Multiplier = 2
		}
		if b.Initial <= 0 {
			v.err("spec.backoff.initial", "must be greater than zero: set the wait after the first decline, e.g. 1s")
		}
		if b.Max < b.Initial {
			v.err("spec.backoff.max", fmt.Sprintf("%s is shorter than spec.backoff.initial %s: set max to at least initial",
				FormatDuration(b.Max), FormatDuration(b.Initial)))
		}
		if !(b.Multiplier >= 1) {
			v.err("spec.backoff.multiplier", fmt.Sprintf("%v is below 1: a multiplier of at least 1 keeps waits from shrinking; use 2 to double each wait", b.Multiplier))
		}
	}
	if caps.SubjectNamesQueue {
		queuePatternRules(v, s)
	}
	if !alo {
		if b.Set() {
			v.err("spec.backoff", "not allowed under mode AtMostOnce, where nothing comes back: remove spec.backoff, or set spec.mode: AtLeastOnce")
		}
		if s.MaxNackDelay != 0 {
			v.err("spec.maxNackDelay", "not allowed under mode AtMostOnce, where nothing comes back: remove spec.maxNackDelay, or set spec.mode: AtLeastOnce")
		}
		for _, f := range []struct {
			field string
			set   bool
		}{{"spec.maxDeliver", s.MaxDeliver != 0}, {"spec.slowHandler", s.slowHandlerSet}, {"spec.ackWait", s.AckWait != 0},
			{"spec.maxProcessingTime", s.MaxProcessingTime != 0}, {"spec.maxInFlight", s.MaxInFlight != 0}} {
			if f.set {
				v.warn(f.field, "has no effect under mode AtMostOnce (nothing is acknowledged or redelivered); remove it, or set spec.mode: AtLeastOnce")
			}
		}
		return
	}
	for _, f := range []struct {
		field string
		delay time.Duration
		set   bool
	}{{"spec.backoff", b.Max, b.Set()}, {"spec.maxNackDelay", s.MaxNackDelay, s.MaxNackDelay != 0}} {
		if !f.set {
			continue
		}
		if !caps.DelaysRedelivery {
			v.err(f.field, "this backend cannot delay a redelivery (it does not declare delaysRedelivery): remove the field, "+
				"or use a backend that can, such as nats")
		} else if limit := caps.MaxRedeliveryDelay; limit > 0 && f.delay > limit {
			what := f.field
			if what == "spec.backoff" {
				what = "spec.backoff.max"
			}
			v.err(what, fmt.Sprintf("%s is longer than this backend can hold a message back (%s): set it to %s or less",
				FormatDuration(f.delay), FormatDuration(limit), FormatDuration(limit)))
		}
	}
	if limit := caps.MaxRedeliveryDelay; b.Set() && limit > 0 && caps.DelaysRedelivery && b.Max <= limit {
		text := ""
		if s.MaxDeliver > 0 {
			var total time.Duration
			for a := 1; a <= min(s.MaxDeliver-1, 10_000); a++ {
				total += ScheduleDelay(b, a)
			}
			if total > limit {
				text = fmt.Sprintf("the schedule waits %s in all over %d declines, longer than this backend can hold a message from its first receive (%s)",
					FormatDuration(total), s.MaxDeliver-1, FormatDuration(limit))
			}
		} else {
			text = fmt.Sprintf("with no maxDeliver the schedule's total wait is unbounded, and this backend can hold a message at most %s from its first receive", FormatDuration(limit))
		}
		if text != "" {
			v.warn("spec.backoff", text+": later declines come back sooner than asked and are counted DelayShortened; set maxDeliver or shorten the schedule")
		}
	}
	if limit := caps.MaxInFlight; limit > 0 && s.MaxInFlight > limit {
		v.err("spec.maxInFlight", fmt.Sprintf("%d is more than this backend can hold unsettled per consumer (%d): set it to %d or less", s.MaxInFlight, limit, limit))
	}
	if caps.AckTimeout == AckTimeoutBrokerWide {
		for _, f := range []struct {
			field string
			set   bool
		}{{"spec.ackWait", s.AckWait != 0}, {"spec.slowHandler", s.slowHandlerSet}, {"spec.maxProcessingTime", s.MaxProcessingTime != 0}} {
			if f.set {
				v.warn(f.field, "has no effect on this backend: it never hands a message on while the channel that received it lives; "+
					"a handler that runs past the broker's own consumer_timeout (RabbitMQ: 30m unless the broker sets it) "+
					"gets its channel closed, and every unsettled message on it is redelivered. Remove the field")
			}
		}
		return
	}
	if s.slowHandlerSet && s.SlowHandler == Redeliver && s.AckWait == 0 {
		v.warn("spec.ackWait", "slowHandler Redeliver without an explicit ackWait: under Redeliver, ackWait is a correctness setting; "+
			"set it longer than your slowest handler run, or duplicate work is routine")
	}
	maxProcessing := s.MaxProcessingTime
	if maxProcessing == 0 {
		maxProcessing = DefaultMaxProcessingTime
	}
	if !(s.slowHandlerSet && s.SlowHandler == Redeliver) && s.AckWait != 0 && maxProcessing < s.AckWait {
		v.warn("spec.maxProcessingTime", fmt.Sprintf("%s is shorter than spec.ackWait %s: under ExtendLease the lease is never extended; "+
			"raise maxProcessingTime or lower ackWait", FormatDuration(maxProcessing), FormatDuration(s.AckWait)))
	}
}

func queuePatternRules(v *Verdict, s SubscriptionSpec) {
	pattern := s.Pattern
	var bad []rune
	for _, c := range pattern {
		if !(c < 128 && (c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_')) {
			bad = append(bad, c)
		}
	}
	if len(bad) > 0 {
		what := fmt.Sprintf("%q", string(bad))
		if strings.ContainsAny(string(bad), "*>") {
			what = "a wildcard"
		}
		v.err("spec.pattern", fmt.Sprintf("%q has %s, and on this backend a subject is the name of one queue (it has no subjects to match): "+
			"set spec.pattern to one literal name of letters, digits, '-' and '_', the same as spec.durableName", pattern, what))
		return
	}
	if len(pattern) > queueNameMax {
		v.err("spec.pattern", fmt.Sprintf("is %d characters long, and a queue name has at most %d: set a shorter name", len(pattern), queueNameMax))
		return
	}
	if s.DurableName != "" && s.DurableName != pattern {
		v.err("spec.pattern", fmt.Sprintf("%q differs from spec.durableName %q: on this backend the durableName names the subscription's queue "+
			"and a subject is a queue's name, so messages published to %q would never reach it; set spec.pattern to %q",
			pattern, s.DurableName, pattern, s.DurableName))
	}
}
