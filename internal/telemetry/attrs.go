package telemetry

import (
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// MaxAttributeValues bounds how many distinct values of one string
// attribute (workflow, phase, topic, failure reason) an instrument set
// records; later values are recorded as OverflowValue. It bounds the
// caches below and the series a misuse (a topic per customer) can create.
const MaxAttributeValues = 1000

// OverflowValue replaces attribute values past MaxAttributeValues.
const OverflowValue = "_other"

// cache maps an attribute value (or a tuple of them) to its precomputed
// measurement options. Reads are one atomic load and a map lookup, with no
// lock and no allocation; a new value copies the map (values are few and
// settle early: workflow names, topics).
type cache[K comparable, V any] struct {
	m     atomic.Pointer[map[K]*V]
	mu    sync.Mutex
	build func(K) *V
	// overflow builds the entry recorded for values past the bound.
	overflow func() *V
	other    *V // built once, under mu
}

func (c *cache[K, V]) get(k K) *V {
	if m := c.m.Load(); m != nil {
		if v, ok := (*m)[k]; ok {
			return v
		}
	}
	return c.add(k)
}

func (c *cache[K, V]) add(k K) *V {
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.m.Load()
	var n int
	if old != nil {
		if v, ok := (*old)[k]; ok {
			return v
		}
		n = len(*old)
	}
	if n >= MaxAttributeValues {
		if c.other == nil {
			c.other = c.overflow()
		}
		return c.other
	}
	next := make(map[K]*V, n+1)
	if old != nil {
		for key, v := range *old {
			next[key] = v
		}
	}
	v := c.build(k)
	next[k] = v
	c.m.Store(&next)
	return v
}

// options holds one attribute set as the option slices the Add and Record
// methods take, so that recording passes no freshly built variadic slice.
type options struct {
	add    []metric.AddOption
	record []metric.RecordOption
}

func newOptions(kvs ...attribute.KeyValue) options {
	o := metric.WithAttributeSet(attribute.NewSet(kvs...))
	return options{add: []metric.AddOption{o}, record: []metric.RecordOption{o}}
}

// stringCache is a cache of options for one string attribute.
func stringCache(key string) *cache[string, options] {
	return &cache[string, options]{
		build: func(v string) *options {
			o := newOptions(attribute.String(key, v))
			return &o
		},
		overflow: func() *options {
			o := newOptions(attribute.String(key, OverflowValue))
			return &o
		},
	}
}
