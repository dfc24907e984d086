package sqs

import (
	"strings"
	"testing"
	"time"
)

// The Rust runtime's table (backend/sqs/hold.rs): (held so far, asked) → (seconds, shortened).
func TestHoldIsTheRustRuntimesTable(t *testing.T) {
	const h = int64(3_600_000)
	const t0 = int64(1_700_000_000_000)
	s := func(n int) time.Duration { return time.Duration(n) * time.Second }
	for _, r := range []struct {
		held      int64
		asked     time.Duration
		seconds   int32
		shortened bool
	}{
		{0, s(0), 0, false}, {0, s(30), 30, false}, {0, s(12 * 3600), 12 * 3600, false}, {0, s(12*3600 + 1), 12 * 3600, true},
		{0, 600 * time.Millisecond, 1, false}, {0, 1001 * time.Millisecond, 2, false},
		{11 * h, s(3600), 3600, false}, {11 * h, s(3601), 3600, true}, {11 * h, s(4 * 3600), 3600, true},
		{12*h - 1500, s(1), 1, false}, {12*h - 1500, s(2), 1, true}, {12*h - 999, s(1), 0, true},
		{12 * h, s(1), 0, true}, {12 * h, s(0), 0, false}, {13 * h, s(60), 0, true}, {13 * h, s(0), 0, false},
	} {
		secs, short := hold(t0, t0+r.held, r.asked, HoldLimit)
		if secs != r.seconds || short != r.shortened {
			t.Errorf("held %d ms, asked %s: %d %v, want %d %v", r.held, r.asked, secs, short, r.seconds, r.shortened)
		}
	}
}

// The report queue is the one the operator makes: the Rust name, hash included.
func TestTheReportQueueIsTheOperators(t *testing.T) {
	if got := reportQueue("orders"); got != "orders-settle-stats.fifo" {
		t.Fatal(got)
	}
	long := strings.Repeat("q", 80)
	if got := reportQueue(long); got != "qqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqq-04945995-settle-stats.fifo" {
		t.Fatal(got)
	}
	if groupOf("orders-7f9c-1796011200000") != "orders-7f9c-1796011200000" || !strings.HasPrefix(groupOf("a b"), "instance-") {
		t.Fatal("an instance is its own message group")
	}
}
