package messaging

// A Subscription resource's manifest (the YAML `kubectl apply` takes) read into a spec, so an
// application runs exactly the policy the operator admitted (the Rust runtime's
// `Subscriber::from_resource`). Pure: it reads bytes, never the cluster.

import (
	"fmt"
	"time"

	yaml "go.yaml.in/yaml/v3"
)

type manifest struct {
	Kind     string `yaml:"kind"`
	Metadata struct {
		Name      string `yaml:"name"`
		Namespace string `yaml:"namespace"`
	} `yaml:"metadata"`
	Spec struct {
		Pattern     string `yaml:"pattern"`
		Stream      string `yaml:"stream"`
		Mode        string `yaml:"mode"`
		DurableName string `yaml:"durableName"`
		MaxDeliver  int    `yaml:"maxDeliver"`
		Backoff     *struct {
			Initial    string  `yaml:"initial"`
			Max        string  `yaml:"max"`
			Multiplier float64 `yaml:"multiplier"`
		} `yaml:"backoff"`
		MaxNackDelay      string `yaml:"maxNackDelay"`
		SlowHandler       string `yaml:"slowHandler"`
		AckWait           string `yaml:"ackWait"`
		MaxProcessingTime string `yaml:"maxProcessingTime"`
		MaxInFlight       int    `yaml:"maxInFlight"`
	} `yaml:"spec"`
}

// SpecFromManifest reads a Subscription manifest: its namespace, and the spec bound to the
// consumer the operator makes for it (OwnedByOperator). The caller sets Handler.
func SpecFromManifest(text []byte) (string, SubscriptionSpec, error) {
	var m manifest
	if err := yaml.Unmarshal(text, &m); err != nil {
		return "", SubscriptionSpec{}, fmt.Errorf("the manifest is not YAML a Subscription has: %w", err)
	}
	if m.Kind != "Subscription" {
		return "", SubscriptionSpec{}, fmt.Errorf("kind %q: the manifest must be a Subscription", m.Kind)
	}
	if m.Metadata.Name == "" {
		return "", SubscriptionSpec{}, fmt.Errorf("metadata.name: the manifest names no Subscription")
	}
	ns := m.Metadata.Namespace
	if ns == "" {
		ns = DefaultNamespace()
	}
	var bad error
	dur := func(field, v string) time.Duration {
		if v == "" {
			return 0
		}
		d, err := time.ParseDuration(v)
		if err != nil && bad == nil {
			bad = fmt.Errorf("%s: %q is not a duration (e.g. 30s, 1m): %w", field, v, err)
		}
		return d
	}
	s := m.Spec
	spec := SubscriptionSpec{
		Name: m.Metadata.Name, Pattern: s.Pattern, Stream: s.Stream, DurableName: s.DurableName,
		MaxDeliver: s.MaxDeliver, MaxNackDelay: dur("spec.maxNackDelay", s.MaxNackDelay),
		AckWait: dur("spec.ackWait", s.AckWait), MaxProcessingTime: dur("spec.maxProcessingTime", s.MaxProcessingTime),
		MaxInFlight: s.MaxInFlight, OwnedByOperator: true,
	}
	switch s.Mode {
	case "", "AtMostOnce":
	case "AtLeastOnce":
		spec.Mode = AtLeastOnce
	default:
		return "", SubscriptionSpec{}, fmt.Errorf("spec.mode: %q is neither AtMostOnce nor AtLeastOnce", s.Mode)
	}
	if b := s.Backoff; b != nil {
		spec.Backoff = Backoff{Initial: dur("spec.backoff.initial", b.Initial), Max: dur("spec.backoff.max", b.Max), Multiplier: b.Multiplier}
	}
	switch s.SlowHandler {
	case "":
	case "ExtendLease":
		spec = spec.WithSlowHandler(ExtendLease)
	case "Redeliver":
		spec = spec.WithSlowHandler(Redeliver)
	default:
		return "", SubscriptionSpec{}, fmt.Errorf("spec.slowHandler: %q is neither ExtendLease nor Redeliver", s.SlowHandler)
	}
	return ns, spec, bad
}
