package main

// The fault campaign's handler (docs/guide/chaos.md), the same draw as the Rust app's
// `model_answer`: each attempt's answer from (seed, message id, attempt), written to the model
// log just before it is sent, so the campaign's checker knows what the handlers did.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	messaging "settle.dev/messaging"
)

func draw(seed, id uint64, attempt int) uint64 {
	x := seed ^ id*0x9E3779B97F4A7C15 ^ uint64(attempt)<<48
	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
	x = (x ^ (x >> 27)) * 0x94D049BB133111EB
	return x ^ (x >> 31)
}

// answer is about 40% ack, 5% ack-error, 5% ack-twice, 5% slow-ack, 15% nack, 10%
// nack-after, 15% silent, 5% silent-error.
func answer(seed, id uint64, attempt int) string {
	switch r := draw(seed, id, attempt) % 100; {
	case r < 40:
		return "ack"
	case r < 45:
		return "ack-error"
	case r < 50:
		return "ack-twice"
	case r < 55:
		return "slow-ack"
	case r < 70:
		return "nack"
	case r < 80:
		return "nack-after"
	case r < 95:
		return "silent"
	default:
		return "silent-error"
	}
}

func delay(seed, id uint64, attempt int) time.Duration {
	return time.Duration(200+(draw(seed, id, attempt)>>8)%1301) * time.Millisecond
}

func model() (messaging.Handler, error) {
	seed, _ := strconv.ParseUint(os.Getenv("SETTLE_APP_MODEL_SEED"), 10, 64)
	path := os.Getenv("SETTLE_APP_MODEL_LOG")
	if path == "" {
		return nil, errors.New("the model handler needs SETTLE_APP_MODEL_LOG, a file to append to")
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	var mu sync.Mutex
	return func(ctx context.Context, d messaging.Delivery) error {
		id, _ := strconv.ParseUint(strings.TrimSpace(string(d.Payload())), 10, 64)
		attempt := d.Attempt()
		said := func(what string) {
			mu.Lock()
			defer mu.Unlock()
			fmt.Fprintf(f, "%d %d %s %d\n", id, attempt, what, time.Now().UnixMilli())
		}
		a, wait := answer(seed, id, attempt), delay(seed, id, attempt)
		if a == "nack-after" {
			said(fmt.Sprintf("nack-after-%dms", wait.Milliseconds()))
		} else {
			said(a)
		}
		var sent error
		switch a {
		case "ack", "ack-error", "ack-twice":
			sent = d.Ack()
		case "slow-ack":
			work(ctx, 3*time.Second)
			sent = d.Ack()
		case "nack":
			sent = d.Nack()
		case "nack-after":
			sent = d.NackAfter(wait)
			var de *messaging.DelayError
			if errors.As(sent, &de) && strings.Contains(sent.Error(), "neither MaxNackDelay nor Backoff") {
				said("no-delay")
				sent = d.Nack()
			}
		}
		if sent == nil {
			said("done")
		} else {
			said("failed")
		}
		if a == "ack-twice" && !errors.Is(d.Nack(), messaging.ErrAlreadySettled) {
			said("settled-twice")
		}
		if strings.HasSuffix(a, "-error") {
			return fmt.Errorf("the model handler's %s for message %d", a, id)
		}
		return sent
	}, nil
}
