package messaging

// The stats report (docs/stats-report.md, format version 1): the document, its key, who this
// process is, and the rate-bounded publishing loop's state. It must not interpret counters
// (the operator sums instances) and must not block handlers.

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"
)

// ReportVersion is the format version this runtime writes.
const ReportVersion = 1

// The report's timing (docs/stats-report.md "When").
const (
	DefaultReportInterval = 5 * time.Second
	// Keepalive: an unchanged subscription is reported again this often.
	Keepalive = 5 * time.Minute
	// MarkRecheck: how often a subscription bound to an operator's consumer reads its mark again.
	MarkRecheck = 5 * time.Second
)

// StatsReport is one report: the cumulative account of one subscription in one instance.
type StatsReport struct {
	Version         int           `json:"version"`
	Namespace       string        `json:"namespace"`
	Subscription    string        `json:"subscription"`
	SubscriptionUID string        `json:"subscriptionUid,omitempty"`
	DurableName     string        `json:"durableName,omitempty"`
	Instance        string        `json:"instance"`
	Backend         string        `json:"backend"`
	Mode            string        `json:"mode"`
	StartedAtMs     uint64        `json:"startedAtMs"`
	ReportedAtMs    uint64        `json:"reportedAtMs"`
	Sequence        uint64        `json:"sequence"`
	Stats           ConsumerStats `json:"stats"`
	Runtime         RuntimeStats  `json:"runtime"`
}

// ReportKey is the KV key of one instance's report of one subscription:
// `<namespace>.<subscription>.<instance>`, each part reduced to the key alphabet.
func ReportKey(namespace, subscription, instance string) string {
	clean := func(s string) string {
		var b strings.Builder
		for _, r := range s {
			if r < 128 && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
				b.WriteRune(r)
			} else {
				b.WriteByte('_')
			}
		}
		if b.Len() == 0 {
			return "_"
		}
		return b.String()
	}
	return clean(namespace) + "." + clean(subscription) + "." + clean(instance)
}

func nowMs() uint64 { return uint64(time.Now().UnixMilli()) }

// DefaultInstance is who this process is: SETTLE_INSTANCE, else HOSTNAME (a pod's name), else
// pid-<pid>; always followed by the start time, so a restarted process is a new instance.
func DefaultInstance() string {
	base := os.Getenv("SETTLE_INSTANCE")
	if base == "" {
		base = os.Getenv("HOSTNAME")
	}
	if base == "" {
		base = fmt.Sprintf("pid-%d", os.Getpid())
	}
	return fmt.Sprintf("%s-%d", base, nowMs())
}

// DefaultNamespace is POD_NAMESPACE, else default.
func DefaultNamespace() string {
	if ns := os.Getenv("POD_NAMESPACE"); ns != "" {
		return ns
	}
	return "default"
}

type lastReport struct {
	stats    ConsumerStats
	runtime  RuntimeStats
	sequence uint64
	at       time.Time
}

// reporter is the publishing loop's state: the last report of each subscription.
type reporter struct {
	namespace, instance, backend string
	sink                         StatsSink
	last                         map[string]*lastReport
}

// tick publishes the reports of subscriptions whose counters changed since their last report
// (all when force). Returns whether every report due was confirmed.
func (r *reporter) tick(ctx context.Context, subs []*Sub, force bool) bool {
	all := true
	for _, s := range subs {
		uid, started, st, rt := s.epochStats()
		l := r.last[s.Name()]
		if l == nil {
			l = &lastReport{at: time.Now()}
			r.last[s.Name()] = l
		}
		fresh := time.Since(l.at) < Keepalive
		if !force && l.sequence > 0 && l.stats == st && l.runtime == rt && fresh {
			continue
		}
		rep := StatsReport{
			Version: ReportVersion, Namespace: r.namespace, Subscription: s.Name(), SubscriptionUID: uid,
			DurableName: s.Policy.DurableName, Instance: r.instance, Backend: r.backend, Mode: s.Policy.Mode.String(),
			StartedAtMs: started, ReportedAtMs: nowMs(), Sequence: l.sequence + 1, Stats: st, Runtime: rt,
		}
		body, err := json.Marshal(rep)
		if err != nil {
			slog.Error("cannot encode a stats report", "error", err)
			all = false
			continue
		}
		if err := r.sink.Put(ctx, ReportKey(rep.Namespace, rep.Subscription, rep.Instance), body); err != nil {
			all = false
			slog.Warn("stats report not published; retrying at the next interval", "subscription", s.Name(), "error", err)
			continue
		}
		*l = lastReport{stats: st, runtime: rt, sequence: rep.Sequence, at: time.Now()}
	}
	return all
}
