package messaging_test

import (
	"encoding/json"
	"os"
	"reflect"
	"testing"
	"time"

	messaging "settle.dev/messaging"
)

type vectorSpec struct {
	Pattern     string `json:"pattern"`
	Mode        string `json:"mode"`
	DurableName string `json:"durableName"`
	MaxDeliver  int    `json:"maxDeliver"`
	Backoff     *struct {
		Initial    string  `json:"initial"`
		Max        string  `json:"max"`
		Multiplier float64 `json:"multiplier"`
	} `json:"backoff"`
	MaxNackDelay      string `json:"maxNackDelay"`
	SlowHandler       string `json:"slowHandler"`
	AckWait           string `json:"ackWait"`
	MaxProcessingTime string `json:"maxProcessingTime"`
	MaxInFlight       int    `json:"maxInFlight"`
	Stream            string `json:"stream"`
}

func dur(t *testing.T, s string) time.Duration {
	if s == "" {
		return 0
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	return d
}

func (v vectorSpec) spec(t *testing.T) messaging.SubscriptionSpec {
	s := messaging.SubscriptionSpec{
		Name: "orders", Pattern: v.Pattern, DurableName: v.DurableName, MaxDeliver: v.MaxDeliver,
		MaxNackDelay: dur(t, v.MaxNackDelay), AckWait: dur(t, v.AckWait),
		MaxProcessingTime: dur(t, v.MaxProcessingTime), MaxInFlight: v.MaxInFlight, Stream: v.Stream,
	}
	if v.Mode == "AtLeastOnce" {
		s.Mode = messaging.AtLeastOnce
	}
	if b := v.Backoff; b != nil {
		s.Backoff = messaging.Backoff{Initial: dur(t, b.Initial), Max: dur(t, b.Max), Multiplier: b.Multiplier}
	}
	switch v.SlowHandler {
	case "Redeliver":
		s = s.WithSlowHandler(messaging.Redeliver)
	case "ExtendLease":
		s = s.WithSlowHandler(messaging.ExtendLease)
	}
	return s
}

// The Rust rules write conformance/admission.json (every create row of their table, word for
// word); the Go runtime must refuse and warn about the same specs in the same words.
func TestTheAdmissionVectorsGiveTheSameFindings(t *testing.T) {
	raw, err := os.ReadFile("../../conformance/admission.json")
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Cases []struct {
			Name     string                 `json:"name"`
			Backend  string                 `json:"backend"`
			Spec     vectorSpec             `json:"spec"`
			Errors   []messaging.FieldIssue `json:"errors"`
			Warnings []messaging.FieldIssue `json:"warnings"`
		} `json:"cases"`
	}
	if err := json.Unmarshal(raw, &file); err != nil {
		t.Fatal(err)
	}
	if len(file.Cases) < 30 {
		t.Fatalf("only %d cases: the file lost its rows", len(file.Cases))
	}
	for _, c := range file.Cases {
		v := messaging.Validate(c.Spec.spec(t), messaging.CapabilitiesOf(c.Backend))
		norm := func(x []messaging.FieldIssue) []messaging.FieldIssue {
			if len(x) == 0 {
				return nil
			}
			return x
		}
		if !reflect.DeepEqual(norm(v.Errors), norm(c.Errors)) {
			t.Errorf("%s on %s: errors\n got %q\nwant %q", c.Name, c.Backend, v.Errors, c.Errors)
		}
		if !reflect.DeepEqual(norm(v.Warnings), norm(c.Warnings)) {
			t.Errorf("%s on %s: warnings\n got %q\nwant %q", c.Name, c.Backend, v.Warnings, c.Warnings)
		}
	}
}
